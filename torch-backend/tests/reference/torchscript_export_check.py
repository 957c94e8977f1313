"""Checks TorchScript files exported by kiln-torch (`kiln_torch::export_torchscript`)
with Python PyTorch alone, for tests/torchscript_export.rs.

Usage:
    python torchscript_export_check.py MANIFEST.json RESULTS.json

MANIFEST.json lists the cases, each with:
    name        the case's name
    file        the exported .pt
    io          a safetensors file with `x` (the input), `y_eval` (Kiln's eval-mode
                output), `y_train` (Kiln's train-mode output, when deterministic),
                `state.<key>` (Kiln's state dict at export) and `after.<key>` (Kiln's
                state dict after one train-mode forward)
    training    the `training` flag the file must carry
    keys        the state-dict keys in PyTorch's order; an item [prefix, file] stands
                for the keys of the TorchScript file `file` under `prefix.`
    trainable   the parameters that require gradients

For each case, in one run: torch.jit.load; the training flag; state_dict() keys (order
too), dtypes and values against Kiln's (bitwise); the eval-mode output against Kiln's;
a fresh load's train-mode forward: the batch-norm running statistics and
num_batches_tracked against Kiln's train-mode forward, and the output where it is
deterministic; and one SGD step (lr 0.1) on a loss, from a fresh load: the input and every
parameter that requires grad get a finite gradient and the parameters change, the others
get none and stay.

Writes RESULTS.json: per case, the largest absolute differences it measured; raises
(non-zero exit) on any structural mismatch.
"""

import json
import sys

import torch
from safetensors.torch import load_file


def max_diff(a, b):
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def expected_keys(items):
    keys = []
    for item in items:
        if isinstance(item, str):
            keys.append(item)
        else:
            prefix, path = item
            inner = torch.jit.load(path).state_dict().keys()
            keys.extend(f"{prefix}.{k}" if prefix else k for k in inner)
    return keys


def check_state(name, module, io, key_prefix, expected_order):
    state = module.state_dict()
    keys = list(state.keys())
    if keys != expected_order:
        raise AssertionError(f"{name}: state_dict keys {keys} != Kiln's {expected_order}")
    worst = 0.0
    for key, value in state.items():
        kiln = io[f"{key_prefix}.{key}"]
        if value.dtype != kiln.dtype:
            raise AssertionError(f"{name}: {key} has dtype {value.dtype}, Kiln's {kiln.dtype}")
        if not torch.equal(value, kiln):
            worst = max(worst, max_diff(value, kiln))
            if worst == 0.0:  # e.g. NaN
                raise AssertionError(f"{name}: {key} differs from Kiln's")
    return worst


def check_case(case):
    name = case["name"]
    io = load_file(case["io"])
    x = io["x"]
    order = expected_keys(case["keys"])
    result = {}

    model = torch.jit.load(case["file"])
    if model.training != case["training"]:
        raise AssertionError(f"{name}: training flag {model.training}, expected {case['training']}")
    result["state"] = check_state(name, model, io, "state", order)
    model.eval()
    with torch.no_grad():
        y = model(x)
    result["eval_output"] = max_diff(y, io["y_eval"])

    # A fresh load in training mode: batch statistics and running statistics.
    model = torch.jit.load(case["file"])
    model.train()
    with torch.no_grad():
        y = model(x)
    if "y_train" in io:
        result["train_output"] = max_diff(y, io["y_train"])
    after = model.state_dict()
    worst = 0.0
    moved = 0.0
    buffers = dict(model.named_buffers())
    for key in buffers:
        kiln = io[f"after.{key}"]
        moved = max(moved, max_diff(after[key], io[f"state.{key}"]))
        if key.endswith("num_batches_tracked"):
            if not torch.equal(after[key], kiln):
                raise AssertionError(
                    f"{name}: {key} is {after[key].item()} after a train-mode forward, "
                    f"Kiln's {kiln.item()}"
                )
        else:
            worst = max(worst, max_diff(after[key], kiln))
    result["train_buffers"] = worst
    result["buffers"] = len(buffers)
    result["train_buffers_moved"] = moved  # how far the forward moved them

    # One SGD step from a fresh load.
    model = torch.jit.load(case["file"])
    model.train()
    params = dict(model.named_parameters())
    trainable = sorted(k for k, p in params.items() if p.requires_grad)
    if trainable != sorted(case["trainable"]):
        raise AssertionError(
            f"{name}: parameters requiring grad {trainable} != Kiln's {sorted(case['trainable'])}"
        )
    before = {k: p.detach().clone() for k, p in params.items()}
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    out = model(x)
    generator = torch.Generator().manual_seed(0)
    projection = torch.randn(out.shape, generator=generator)
    loss = (out.float() * projection).sum()
    loss.backward()
    if x.is_floating_point() and (x.grad is None or not torch.isfinite(x.grad).all()):
        raise AssertionError(f"{name}: the input has no finite gradient after backward")
    for key, p in params.items():
        if p.requires_grad:
            if p.grad is None or not torch.isfinite(p.grad).all():
                raise AssertionError(f"{name}: {key} has no finite gradient after backward")
        elif p.grad is not None:
            raise AssertionError(f"{name}: frozen {key} got a gradient")
    if trainable:
        torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.1).step()
    changed = 0
    for key, p in params.items():
        same = torch.equal(p.detach(), before[key])
        if p.requires_grad and same:
            raise AssertionError(f"{name}: {key} did not change after an SGD step")
        if not p.requires_grad and not same:
            raise AssertionError(f"{name}: frozen {key} changed after an SGD step")
        changed += not same
    result["sgd_changed"] = changed
    result["sgd_loss"] = loss.item()
    return result


def main():
    manifest_path, results_path = sys.argv[1], sys.argv[2]
    with open(manifest_path) as f:
        cases = json.load(f)
    torch.manual_seed(0)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = check_case(case)
        except Exception as e:
            raise AssertionError(f"case {case['name']}: {e}") from e
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"checked {len(results)} exported models")


if __name__ == "__main__":
    main()
