"""PyTorch references for kiln-tf's loss graphs (tf-backend/src/loss.rs).

Usage:
    python losses.py CASES.json OUT.safetensors

CASES.json is {"cases": [CASE, ...]} with

    CASE = {"name": str,
            "loss": {"type": "cross_entropy" | "nll" | "mse" | "l1" | "smooth_l1"
                             | "bce_with_logits",
                     "reduction": "mean" | "sum" | "none",
                     and, by type, "weight": [float] | null, "ignore_index": int,
                     "label_smoothing": float, "beta": float,
                     "pos_weight": [float] | null},
            "input": T, "target": T}
    T = {"shape": [int], "dtype": "float32" | "int64", "data": [flat values]}

For each case it computes the loss with torch.nn.functional in float32 on the CPU,
back-propagates a gradient of ones (what tf.Graph's add_gradients does with no
initial gradients), and writes "<name>/value" (the loss: a scalar, or the
per-element tensor for reduction "none") and "<name>/grad" (d loss / d input) to
OUT.safetensors. One line per case goes to stdout.
"""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

DTYPES = {"float32": torch.float32, "int64": torch.int64}


def tensor(spec):
    return torch.tensor(spec["data"], dtype=DTYPES[spec["dtype"]]).reshape(spec["shape"])


def weights(values):
    return None if values is None else torch.tensor(values, dtype=torch.float32)


def loss_value(loss, x, y):
    kind, reduction = loss["type"], loss["reduction"]
    if kind == "cross_entropy":
        return F.cross_entropy(
            x,
            y,
            weight=weights(loss.get("weight")),
            ignore_index=loss.get("ignore_index", -100),
            reduction=reduction,
            label_smoothing=loss.get("label_smoothing", 0.0),
        )
    if kind == "nll":
        return F.nll_loss(
            x,
            y,
            weight=weights(loss.get("weight")),
            ignore_index=loss.get("ignore_index", -100),
            reduction=reduction,
        )
    if kind == "mse":
        return F.mse_loss(x, y, reduction=reduction)
    if kind == "l1":
        return F.l1_loss(x, y, reduction=reduction)
    if kind == "smooth_l1":
        return F.smooth_l1_loss(x, y, reduction=reduction, beta=loss.get("beta", 1.0))
    if kind == "bce_with_logits":
        return F.binary_cross_entropy_with_logits(
            x, y, reduction=reduction, pos_weight=weights(loss.get("pos_weight"))
        )
    raise ValueError(f"unknown loss type {kind!r}")


def main(cases_path, out_path):
    torch.use_deterministic_algorithms(True)
    with open(cases_path) as f:
        cases = json.load(f)["cases"]
    out = {}
    for case in cases:
        name = case["name"]
        x = tensor(case["input"]).requires_grad_(True)
        y = tensor(case["target"])
        value = loss_value(case["loss"], x, y)
        value.backward(torch.ones_like(value))
        out[f"{name}/value"] = value.detach().contiguous()
        out[f"{name}/grad"] = x.grad.detach().contiguous()
        shown = value.item() if value.dim() == 0 else list(value.shape)
        print(f"{name}: {shown}")
    save_file(out, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
