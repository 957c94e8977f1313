"""References for kiln-torch's loss and state-dict tests, made by Python PyTorch.

Usage:
    python state_and_losses.py losses CASES.json OUT.safetensors
        CASES.json: [{"name", "loss": <kiln Loss>, "input": [dims], "target": "class" |
        "probs" | "same", "classes": int, "seed": int}]. Writes `<name>.input`,
        `<name>.target`, `<name>.loss` and `<name>.grad` (d sum(loss) / d input).
    python state_and_losses.py export LAYER.json OUT_DIR
        builds the kiln Layer with torch.nn, saves its state_dict with
        safetensors.torch.save_file to OUT_DIR/python_state.safetensors, and an input
        `x` and the eval-mode output `y` to OUT_DIR/python_io.safetensors.
    python state_and_losses.py import LAYER.json STATE.safetensors IO.safetensors OUT.safetensors
        loads STATE (written by Kiln) into the torch.nn model with load_state_dict
        (strict) and writes its eval-mode output on `x` as `y`.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "platform-core", "tests", "reference"))
from model_specs import build  # noqa: E402


def loss_fn(spec, x, t):
    kind = spec["type"]
    reduction = spec.get("reduction", "mean")
    weight = lambda key: None if spec.get(key) is None else torch.tensor(spec[key], dtype=x.dtype)  # noqa: E731
    if kind == "cross_entropy":
        ignore = spec.get("ignore_index")
        return F.cross_entropy(x, t, weight=weight("weight"), ignore_index=-100 if ignore is None else ignore,
                               reduction=reduction, label_smoothing=spec.get("label_smoothing", 0.0))
    if kind == "nll":
        ignore = spec.get("ignore_index")
        return F.nll_loss(x, t, weight=weight("weight"), ignore_index=-100 if ignore is None else ignore,
                          reduction=reduction)
    if kind == "mse":
        return F.mse_loss(x, t, reduction=reduction)
    if kind == "l1":
        return F.l1_loss(x, t, reduction=reduction)
    if kind == "smooth_l1":
        return F.smooth_l1_loss(x, t, reduction=reduction, beta=spec.get("beta", 1.0))
    if kind == "bce_with_logits":
        return F.binary_cross_entropy_with_logits(x, t, pos_weight=weight("pos_weight"), reduction=reduction)
    raise ValueError(kind)


def losses(cases_path, out_path):
    with open(cases_path) as f:
        cases = json.load(f)
    out = {}
    for case in cases:
        torch.manual_seed(case["seed"])
        x = torch.randn(case["input"], requires_grad=True)
        if case["target"] == "class":
            shape = [case["input"][0]] + case["input"][2:]
            t = torch.randint(0, case["classes"], shape)
            if case.get("ignore") is not None:
                t[0] = case["ignore"]
        elif case["target"] == "probs":
            t = torch.softmax(torch.randn(case["input"]), dim=1)
        elif case["target"] == "binary":
            t = torch.randint(0, 2, case["input"]).float()
        else:
            t = torch.randn(case["input"])
        loss = loss_fn(case["loss"], x, t)
        loss.sum().backward()
        name = case["name"]
        out.update({f"{name}.input": x.detach(), f"{name}.target": t, f"{name}.loss": loss.detach(),
                    f"{name}.grad": x.grad})
    save_file({k: v.contiguous() for k, v in out.items()}, out_path)


def export(layer_path, out_dir):
    with open(layer_path) as f:
        layer = json.load(f)
    torch.manual_seed(5)
    model = build(layer)
    with torch.no_grad():  # non-trivial running statistics
        model.train()
        model(torch.randn(8, 1, 10, 10))
    model.eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              os.path.join(out_dir, "python_state.safetensors"))
    x = torch.randn(3, 1, 10, 10)
    with torch.no_grad():
        y = model(x)
    save_file({"x": x, "y": y}, os.path.join(out_dir, "python_io.safetensors"))


def import_(layer_path, state_path, io_path, out_path):
    with open(layer_path) as f:
        layer = json.load(f)
    model = build(layer)
    model.load_state_dict(load_file(state_path), strict=True)
    model.eval()
    with torch.no_grad():
        y = model(load_file(io_path)["x"])
    save_file({"y": y}, out_path)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"losses": losses, "export": export, "import": import_}[command](*args)
