"""Loads the example's Rust ops into Python's torch and checks them against
compositions of torch's own ops, forward and backward; runs gradcheck (float64)
and torch.library.opcheck on them; scripts a module calling them and saves it
for the Rust side, with its inputs and output.

    python torch_library.py <path of libkiln_example_rust_op_torch.so> <output dir>

Prints one JSON object: the largest relative differences (relative to
max(1, |reference|)) by case, the opcheck results, and the TorchScript case.
Failures of gradcheck or opcheck raise (a non-zero exit)."""

import json
import os
import sys

import torch

library, out_dir = sys.argv[1], sys.argv[2]
torch.ops.load_library(library)
ops = torch.ops.example_rs
torch.manual_seed(0)


def worst(actual, expected):
    """The largest |actual - expected| / max(1, |expected|)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return ((actual - expected).abs() / expected.abs().clamp_min(1.0)).max().item()


def rms_norm_reference(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


diffs = {}
for dtype, tag in [(torch.float32, "f32"), (torch.float64, "f64")]:
    x = torch.randn(6, 3, 16, dtype=dtype, requires_grad=True)
    w = (torch.rand(16, dtype=dtype) + 0.5).requires_grad_()

    y = ops.squared_relu(x)
    reference = torch.relu(x) ** 2
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (rdx,) = torch.autograd.grad(reference, x, g)
    diffs[f"squared_relu forward {tag}"] = worst(y, reference)
    diffs[f"squared_relu grad x {tag}"] = worst(dx, rdx)

    for eps in (None, 1e-2):
        y = ops.rms_norm(x, w) if eps is None else ops.rms_norm(x, w, eps=eps)
        reference = rms_norm_reference(x, w, 1e-6 if eps is None else eps)
        g = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, w), g)
        rdx, rdw = torch.autograd.grad(reference, (x, w), g)
        case = f"rms_norm eps={eps or 'default'}"
        diffs[f"{case} forward {tag}"] = worst(y, reference)
        diffs[f"{case} grad x {tag}"] = worst(dx, rdx)
        diffs[f"{case} grad weight {tag}"] = worst(dw, rdw)

# gradcheck: float64 finite differences against the op's backward.
x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
w = (torch.rand(5, dtype=torch.float64) + 0.5).requires_grad_()
assert torch.autograd.gradcheck(ops.squared_relu, (x,))
assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, eps=1e-3), (x, w))

# opcheck: schema, autograd registration, fake tensors (the Meta kernel),
# AOT dispatch (static and dynamic shapes), each op with its gradient.
opcheck = {}
for name, op, args, kwargs in [
    ("squared_relu f32", ops.squared_relu.default, (torch.randn(4, 8, requires_grad=True),), {}),
    ("rms_norm f32", ops.rms_norm.default,
     (torch.randn(4, 8, requires_grad=True), torch.rand(8, requires_grad=True)), {}),
    ("rms_norm f64 eps", ops.rms_norm.default,
     (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True),
      torch.rand(8, dtype=torch.float64, requires_grad=True)), {"eps": 1e-3}),
    ("squared_relu_backward f32", ops.squared_relu_backward.default,
     (torch.randn(4, 8), torch.randn(4, 8)), {}),
    ("rms_norm_backward f32", ops.rms_norm_backward.default,
     (torch.randn(4, 8), torch.randn(4, 8), torch.rand(8)), {}),
]:
    result = torch.library.opcheck(op, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), (name, result)
    opcheck[name] = result

# Errors are RuntimeErrors with the kernel's message; the process goes on.
errors = {}
try:
    ops.rms_norm(torch.randn(2, 8), torch.rand(7))
except RuntimeError as e:
    errors["bad weight"] = str(e).splitlines()[0]
try:
    ops.squared_relu(torch.randn(3, dtype=torch.float16))
except RuntimeError as e:
    errors["float16"] = str(e).splitlines()[0]


# A second copy of the library (another path, so the loader runs its
# constructor again): registering the ops again fails, reported on stderr,
# and the process and the ops registered first go on.
import shutil
import tempfile

copy = os.path.join(out_dir, "copy_of_" + os.path.basename(library))
shutil.copyfile(library, copy)
with tempfile.TemporaryFile(mode="w+b") as captured:
    sys.stderr.flush()
    saved_fd = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
        torch.ops.load_library(copy)
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
    captured.seek(0)
    errors["second load"] = captured.read().decode(errors="replace")
diffs["squared_relu after a second load f64"] = worst(
    ops.squared_relu(torch.tensor([-1.0, 2.0], dtype=torch.float64)),
    torch.tensor([0.0, 4.0], dtype=torch.float64))


# TorchScript: a scripted module calling the ops, saved for the Rust side.
class Block(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.example_rs.rms_norm(torch.ops.example_rs.squared_relu(x), w, eps=1e-5)


scripted = torch.jit.script(Block())
path = os.path.join(out_dir, "block.pt")
scripted.save(path)
x = torch.randn(4, 8, dtype=torch.float64)
w = torch.rand(8, dtype=torch.float64) + 0.5
y = torch.jit.load(path)(x, w)
diffs["torchscript vs composition f64"] = worst(
    y, rms_norm_reference(torch.relu(x) ** 2, w, 1e-5))

print(json.dumps({
    "diffs": diffs,
    "opcheck": opcheck,
    "errors": errors,
    "script": {
        "path": path,
        "x": x.flatten().tolist(),
        "w": w.tolist(),
        "y": y.flatten().tolist(),
        "shape": list(x.shape),
        "graph": str(scripted.graph),
    },
}))
