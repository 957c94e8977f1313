"""torchvision 0.26 (transforms.v2, on tensors) references for kiln-data's vision module.

Usage: vision_parity.py DIR

DIR/cases.json lists
  "inputs": {name: {"dtype": "uint8" | "float32", "shape": [...]}}, read from DIR/<name>.bin
  "cases":  [{"name", "input", "op", "args"}]
and every case's output is written, raw little-endian, to DIR/<case>.out, with
DIR/results.json giving {case: {"dtype", "shape"}}. Run by tests/vision_parity.rs.
"""

import json
import os
import sys

import numpy as np
import torch
import torchvision
import torchvision.transforms.functional as F1
import torchvision.transforms.v2.functional as F

assert torchvision.__version__.startswith("0.26"), torchvision.__version__
torch.set_num_threads(1)

DTYPES = {"uint8": (np.uint8, torch.uint8), "float32": (np.float32, torch.float32)}


def load(root, name, meta):
    np_dtype, _ = DTYPES[meta["dtype"]]
    data = np.fromfile(os.path.join(root, name + ".bin"), dtype=np_dtype)
    return torch.from_numpy(data.reshape(meta["shape"]).copy())


def color(op, x, factor):
    return {
        "brightness": F.adjust_brightness,
        "contrast": F.adjust_contrast,
        "saturation": F.adjust_saturation,
        "hue": F.adjust_hue,
    }[op](x, factor)


def run(x, op, a):
    if op == "resize":
        return F.resize(x, size=a["size"], max_size=a.get("max_size"), antialias=True)
    if op == "center_crop":
        return F.center_crop(x, a["size"])
    if op == "crop":
        return F.crop(x, a["top"], a["left"], a["height"], a["width"])
    if op == "resized_crop":
        return F.resized_crop(
            x, a["top"], a["left"], a["height"], a["width"], size=a["size"], antialias=True
        )
    if op == "hflip":
        return F.horizontal_flip(x)
    if op == "normalize":
        return F.normalize(x, mean=a["mean"], std=a["std"])
    if op == "to_tensor_v1":
        # the classic ToTensor on an HWC array (divides by 255)
        return F1.to_tensor(x.permute(1, 2, 0).numpy())
    if op == "to_dtype_scale":
        # v2's replacement, ToDtype(float32, scale=True) (multiplies by 1/255)
        return F.to_dtype(x, torch.float32, scale=True)
    if op in ("brightness", "contrast", "saturation", "hue"):
        return color(op, x, a["factor"])
    if op == "jitter":
        # ColorJitter.transform with fixed parameters: the ops in the drawn order
        for name, factor in a["steps"]:
            x = color(name, x, factor)
        return x
    raise ValueError(f"unknown op {op}")


def main():
    root = sys.argv[1]
    with open(os.path.join(root, "cases.json")) as f:
        spec = json.load(f)
    inputs = {name: load(root, name, meta) for name, meta in spec["inputs"].items()}
    results = {}
    for case in spec["cases"]:
        y = run(inputs[case["input"]], case["op"], case["args"]).contiguous()
        arr = y.numpy()
        arr.tofile(os.path.join(root, case["name"] + ".out"))
        results[case["name"]] = {"dtype": str(arr.dtype), "shape": list(arr.shape)}
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump(results, f)
    print(f"{len(results)} cases")


if __name__ == "__main__":
    main()
