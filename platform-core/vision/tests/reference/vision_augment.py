"""torchvision 0.26 (transforms.v2, on tensors) references for kiln-data's augmentations.

Usage: vision_augment.py DIR

DIR/cases.json lists
  "inputs": {name: {"dtype": "uint8" | "float32", "shape": [...]}}, read from DIR/<name>.bin
  "cases":  [{"name", "input", "op", "args"}]
and every case's output is written, raw little-endian, to DIR/<case>.out, with
DIR/results.json giving {case: {"dtype", "shape"}}. Run by tests/vision_augment.rs.

Random transforms are replayed: the transform is torchvision's own class, with
`make_params` replaced by the parameters Kiln drew (and `p = 1` where Kiln's
draw applied the transform), so `transform()` runs exactly as in training.
"""

import json
import os
import sys

import numpy as np
import torch
import torchvision
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as F
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2._utils import _setup_fill_arg
from torchvision.transforms.v2.functional._geometry import _get_perspective_coeffs

assert torchvision.__version__.startswith("0.26"), torchvision.__version__
torch.set_num_threads(1)

DTYPES = {"uint8": (np.uint8, torch.uint8), "float32": (np.float32, torch.float32)}
MODES = {"nearest": InterpolationMode.NEAREST, "bilinear": InterpolationMode.BILINEAR}


def load(root, name, meta):
    np_dtype, _ = DTYPES[meta["dtype"]]
    data = np.fromfile(os.path.join(root, name + ".bin"), dtype=np_dtype)
    return torch.from_numpy(data.reshape(meta["shape"]).copy())


def fill_arg(fill):
    """Kiln's fill: null (zeros, no mask), one value, or one per channel."""
    if fill is None:
        return None
    return fill[0] if len(fill) == 1 else list(fill)


def replay(transform, params, x):
    """Runs `transform` on `x` with `params` in place of its own draw."""
    transform.make_params = lambda flat_inputs: params
    return transform(x)


def run(x, op, a):
    if op == "pad":
        return F.pad(x, padding=a["padding"], fill=fill_arg(a["fill"]), padding_mode=a["mode"])
    if op == "random_crop":
        t = T.RandomCrop(
            a["size"],
            padding=a["padding"],
            pad_if_needed=a["pad_if_needed"],
            fill=fill_arg(a["fill"]),
            padding_mode=a["mode"],
        )
        p = a["params"]
        h, w = x.shape[-2:]
        l, t_, r, b = p["padding"]
        params = dict(
            needs_crop=(h + t_ + b > a["size"][0]) or (w + l + r > a["size"][1]),
            top=p["top"],
            left=p["left"],
            height=a["size"][0],
            width=a["size"][1],
            needs_pad=any(p["padding"]),
            padding=p["padding"],
        )
        return replay(t, params, x)
    if op == "grayscale":
        return F.rgb_to_grayscale(x, num_output_channels=a["channels"])
    if op == "random_grayscale":
        t = T.RandomGrayscale(p=1.0 if a["applied"] else 0.0)
        return replay(t, dict(num_input_channels=x.shape[-3]), x)
    if op == "gaussian_blur":
        return F.gaussian_blur(x, kernel_size=a["kernel_size"], sigma=a["sigma"])
    if op == "random_gaussian_blur":
        t = T.GaussianBlur(a["kernel_size"], sigma=a["range"])
        return replay(t, dict(sigma=[a["sigma"], a["sigma"]]), x)
    if op == "erase":
        c = x.shape[-3]
        v = torch.tensor(a["values"], dtype=torch.float32)
        v = v.reshape(c, a["h"], a["w"]) if v.numel() == c * a["h"] * a["w"] else v[:, None, None]
        return F.erase(x, a["i"], a["j"], a["h"], a["w"], v)
    if op == "random_erasing":
        value = a["value"]
        value = "random" if value == "random" else (value[0] if len(value) == 1 else value)
        t = T.RandomErasing(p=1.0 if a["params"] else 0.0, scale=a["scale"], ratio=a["ratio"], value=value)
        if not a["params"]:
            return t(x)
        p = a["params"]
        c = x.shape[-3]
        v = torch.tensor(p["values"], dtype=torch.float32)
        v = v.reshape(c, p["h"], p["w"]) if v.numel() == c * p["h"] * p["w"] else v[:, None, None]
        return replay(t, dict(i=p["i"], j=p["j"], h=p["h"], w=p["w"], v=v), x)
    if op == "affine":
        return F.affine(
            x,
            angle=a["angle"],
            translate=a["translate"],
            scale=a["scale"],
            shear=a["shear"],
            interpolation=MODES[a["mode"]],
            fill=fill_arg(a["fill"]),
            center=a["center"],
        )
    if op == "rotate":
        return F.rotate(
            x,
            angle=a["angle"],
            interpolation=MODES[a["mode"]],
            expand=a["expand"],
            center=a["center"],
            fill=fill_arg(a["fill"]),
        )
    if op == "perspective":
        return F.perspective(
            x,
            startpoints=a["start"],
            endpoints=a["end"],
            interpolation=MODES[a["mode"]],
            fill=fill_arg(a["fill"]),
        )
    if op == "random_rotation":
        t = T.RandomRotation(a["degrees"], interpolation=MODES[a["mode"]], expand=a["expand"], fill=fill_arg(a["fill"]))
        return replay(t, dict(angle=a["angle"]), x)
    if op == "random_affine":
        t = T.RandomAffine(
            a["degrees"],
            translate=a["translate_range"],
            scale=a["scale_range"],
            shear=a["shear_range"],
            interpolation=MODES[a["mode"]],
            fill=fill_arg(a["fill"]),
        )
        p = a["params"]
        params = dict(angle=p["angle"], translate=tuple(p["translate"]), scale=p["scale"], shear=tuple(p["shear"]))
        return replay(t, params, x)
    if op == "random_perspective":
        t = T.RandomPerspective(
            distortion_scale=a["distortion_scale"],
            p=1.0 if a["end"] else 0.0,
            interpolation=MODES[a["mode"]],
            fill=fill_arg(a["fill"]),
        )
        if not a["end"]:
            return t(x)
        h, w = x.shape[-2:]
        start = [[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]]
        return replay(t, dict(coefficients=_get_perspective_coeffs(start, a["end"])), x)
    if op == "functional":
        return getattr(F, a["fn"])(x, **a["kwargs"])
    if op == "augment_op":
        return augment_op(x, a["op"], a["magnitude"], MODES[a["mode"]], fill_arg(a["fill"]))
    if op == "augment_policy":
        for name, magnitude in a["steps"]:
            x = augment_op(x, name, magnitude, MODES[a["mode"]], fill_arg(a["fill"]))
        return x
    raise ValueError(f"unknown op {op}")


def augment_op(x, name, magnitude, interpolation, fill):
    """One AutoAugment operation, through torchvision's own dispatcher."""
    return T.RandAugment(interpolation=interpolation)._apply_image_or_video_transform(
        x, name, magnitude, interpolation=interpolation, fill=_setup_fill_arg(fill)
    )


def main():
    root = sys.argv[1]
    with open(os.path.join(root, "cases.json")) as f:
        spec = json.load(f)
    inputs = {name: load(root, name, meta) for name, meta in spec["inputs"].items()}
    results = {}
    for case in spec["cases"]:
        y = run(inputs[case["input"]].clone(), case["op"], case["args"]).contiguous()
        arr = y.numpy()
        arr.tofile(os.path.join(root, case["name"] + ".out"))
        results[case["name"]] = {"dtype": str(arr.dtype), "shape": list(arr.shape)}
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f)
    print(f"{len(results)} cases")


if __name__ == "__main__":
    main()
