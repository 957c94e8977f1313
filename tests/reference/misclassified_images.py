"""The misclassified validation images of a run ([logging]
misclassified_images), read back with TensorBoard's EventAccumulator and
checked against PyTorch (tests/cli_tools.rs).

Usage: misclassified_images.py LOGDIR DIGITS_CSV_GZ VAL_INDICES_JSON MODEL_SAFETENSORS COUNT

The run is the test's small CNN on the digits: validation sample p is row
VAL_INDICES_JSON[p] of DIGITS_CSV_GZ, its 64 pixels / 16 as a [1, 8, 8]
image. MODEL_SAFETENSORS holds the final weights (those of the last epoch).

For every epoch's event the script parses the table, rebuilds the grid of the
samples it names with `torchvision.utils.make_grid(normalize=True,
scale_each=True)` and `torch.utils.tensorboard.summary.image` (what
`SummaryWriter.add_image` writes), and compares pixels. For the last epoch it
runs the model in PyTorch over the validation split and gives its own first
COUNT misclassified samples. Prints one JSON object:

    {"epochs": [{"step", "width", "height", "channels", "wrong", "seen",
                 "rows": [[sample, class, predicted, probability], ...],
                 "labels_match": bool, "pixels_max_diff": int}],
     "torch": {"wrong", "seen", "rows": [[sample, class, predicted, probability], ...]}}
"""

import gzip
import io
import json
import re
import sys

# TensorFlow is not needed, and importing it (as TensorBoard and
# torch.utils.tensorboard do when they find it) takes seconds: both fall back
# on TensorBoard's own protobufs.
sys.modules["tensorflow"] = None

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from torch.utils.tensorboard.summary import image as image_summary  # noqa: E402
from torchvision.utils import make_grid  # noqa: E402

TAG = "val_misclassified"


def class_of(cell):
    """The class index of a table cell: "7" or "name (7)"."""
    m = re.search(r"\((\d+)\)$", cell)
    return int(m.group(1) if m else cell)


def parse(table):
    head = re.match(r"Epoch (\d+): (\d+) of (\d+) validation samples misclassified", table)
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].isdigit():
            rows.append([int(cells[1]), class_of(cells[2]), class_of(cells[3]), float(cells[4])])
    return int(head.group(1)), int(head.group(2)), int(head.group(3)), rows


def decode(png):
    return np.asarray(Image.open(io.BytesIO(png)))


def main():
    logdir, digits, indices, weights, count = sys.argv[1:6]
    with gzip.open(digits, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    rows = json.loads(open(indices).read())
    x = torch.tensor(table[rows, :64] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(table[rows, 64], dtype=torch.int64)

    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.IMAGES: 0, event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    images = {e.step: e for e in acc.Images(TAG)}
    epochs = []
    for t in acc.Tensors(TAG):
        text = t.tensor_proto.string_val[0].decode()
        epoch, wrong, seen, found = parse(text)
        assert epoch == t.step, (epoch, t.step)
        entry = {"step": t.step, "wrong": wrong, "seen": seen, "rows": found}
        samples = [r[0] for r in found]
        entry["labels_match"] = all(int(y[s]) == r[1] for s, r in zip(samples, found))
        if samples:
            event = images[t.step]
            ours = decode(event.encoded_image_string)
            grid = make_grid(x[samples], nrow=8, padding=2, normalize=True, scale_each=True)
            theirs = decode(image_summary(TAG, grid, dataformats="CHW").value[0].image.encoded_image_string)
            # make_grid repeats a grey image's channel three times.
            assert ours.ndim == 2 and theirs.shape == ours.shape + (3,), (ours.shape, theirs.shape)
            assert (theirs[..., 0] == theirs[..., 1]).all() and (theirs[..., 0] == theirs[..., 2]).all()
            diff = np.abs(ours.astype(np.int64) - theirs[..., 0].astype(np.int64))
            entry.update(
                width=event.width,
                height=event.height,
                png_width=ours.shape[1],
                png_height=ours.shape[0],
                pixels_max_diff=int(diff.max()),
            )
        epochs.append(entry)

    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(128, 10),
    )
    model.load_state_dict(load_file(weights))
    model.eval()
    with torch.no_grad():
        probs = torch.softmax(model(x).double(), dim=1)
    predicted = probs.argmax(dim=1)
    wrong = (predicted != y).nonzero().flatten().tolist()
    first = [[s, int(y[s]), int(predicted[s]), float(probs[s, predicted[s]])] for s in wrong[: int(count)]]
    print(json.dumps({"epochs": epochs, "torch": {"wrong": len(wrong), "seen": len(y), "rows": first}}))


if __name__ == "__main__":
    main()
