"""PyTorch's side of tests/cli_images.rs's `predictions_equal_pytorchs_on_jpeg_and_png`.

Usage:
  python vision_predict.py prepare DIR
      Writes DIR/val/{cat,dog}/ (photo-like images of several sizes: JPEG 4:2:0,
      4:4:4, progressive, grayscale and CMYK, and PNG) and DIR/backbone.pt, a
      torchvision resnet18 without its classifier (seed 0), scripted.
  python vision_predict.py reference DIR WEIGHTS
      Prints, as JSON, the logits PyTorch computes for every image of DIR/val in
      torchvision ImageFolder's order: Pillow decodes (`convert("RGB")`), then
      transforms.v2 on the uint8 tensor (Resize(72), CenterCrop(64),
      ToDtype(float32, scale=True), Normalize), then the backbone and the head
      loaded from Kiln's WEIGHTS (model.safetensors: "0.*" the backbone, "1.*" the head),
      in batches of 4 as the test's `kiln predict`.
"""

import json
import os
import sys
import warnings

import numpy as np
import torch
from PIL import Image

warnings.filterwarnings("ignore")
import torchvision  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def backbone():
    model = torchvision.models.resnet18(weights=None)
    model.fc = torch.nn.Identity()
    return model.eval()


def picture(rng, h, w, c=3):
    y, x = np.mgrid[0:h, 0:w]
    planes = []
    for i in range(c):
        v = 40 + 150 * (x / w) * (i + 1) / c + 60 * (y / h)
        disc = (y / h - 0.4 - 0.1 * i) ** 2 + (x / w - 0.5) ** 2 < 0.05
        v = np.where(disc, 220 - 40 * i, v)
        v = v + rng.normal(0, 14, (h, w))
        planes.append(np.clip(v, 0, 255))
    arr = np.stack(planes, -1).astype(np.uint8)
    return arr[..., 0] if c == 1 else arr


def prepare(out):
    rng = np.random.default_rng(7)
    for cls, sizes in [("cat", [(375, 500), (333, 500), (240, 180)]),
                       ("dog", [(500, 375), (300, 300), (131, 97)])]:
        d = os.path.join(out, "val", cls)
        os.makedirs(d, exist_ok=True)
        for i, (h, w) in enumerate(sizes):
            Image.fromarray(picture(rng, h, w)).save(os.path.join(d, f"{i}_420.jpg"), quality=85)
            Image.fromarray(picture(rng, h, w)).save(os.path.join(d, f"{i}.png"))
        Image.fromarray(picture(rng, 200, 260)).save(os.path.join(d, "prog_444.jpg"), quality=92,
                                                     progressive=True, subsampling=0)
        Image.fromarray(picture(rng, 150, 170, 1), "L").save(os.path.join(d, "gray.jpg"))
        Image.fromarray(picture(rng, 120, 90, 4), "CMYK").save(os.path.join(d, "cmyk.jpg"))
        Image.fromarray(picture(rng, 101, 133)).save(os.path.join(d, "lossy.webp"), quality=80)
    torch.manual_seed(0)
    torch.jit.script(backbone()).save(os.path.join(out, "backbone.pt"))


def reference(out, weights):
    state = load_file(weights)
    body = backbone()
    body.load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("0.")})
    head = torch.nn.Linear(512, 2)
    head.load_state_dict({k[2:]: v for k, v in state.items() if k.startswith("1.")})
    model = torch.nn.Sequential(body, head).eval()
    transform = v2.Compose([
        v2.PILToTensor(), v2.Resize(72, antialias=True), v2.CenterCrop(64),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD),
    ])
    folder = ImageFolder(os.path.join(out, "val"),
                         loader=lambda p: Image.open(p).convert("RGB"))
    rows = []
    samples = folder.samples
    with torch.no_grad():
        # In batches of 4 in the folder's order, as `kiln predict` runs them.
        for start in range(0, len(samples), 4):
            batch = samples[start:start + 4]
            x = torch.stack([transform(folder.loader(p)) for p, _ in batch])
            for (path, label), logits in zip(batch, model(x)):
                rows.append({"path": path, "label": label, "logits": logits.tolist()})
    print(json.dumps(rows))


if __name__ == "__main__":
    if sys.argv[1] == "prepare":
        prepare(sys.argv[2])
    else:
        reference(sys.argv[2], sys.argv[3])
