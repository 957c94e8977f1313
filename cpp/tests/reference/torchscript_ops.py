"""The `kiln` ops in Python, from the library Kiln's build compiled.

Usage: python torchscript_ops.py LIBRARY OUT_DIR

Loads LIBRARY with torch.ops.load_library, checks each op against the equivalent
composition of built-in torch ops (forward and gradients, float32) and with
torch.autograd.gradcheck (float64), then scripts a module that calls
torch.ops.kiln.* and saves it with its input and output for Kiln to run:

    OUT_DIR/model.pt, OUT_DIR/io.json  {"x": T, "target": T, "logits": T, "loss": T}
    where T is {"shape": [...], "data": [flat values]}.
"""

import json
import sys

import torch
import torch.nn.functional as F

library, out_dir = sys.argv[1], sys.argv[2]
torch.ops.load_library(library)
torch.manual_seed(0)
ops = torch.ops.kiln


def close(name, a, b, tol=1e-5):
    err = (a - b).abs().max().item()
    assert err < tol, f"{name}: max |diff| {err}"
    print(f"{name}: max |diff| {err:.2e}")


# bias + GELU
x = torch.randn(16, 24, requires_grad=True)
b = torch.randn(24, requires_grad=True)
y = ops.bias_gelu(x, b)
ref = F.gelu(x + b)
close("bias_gelu forward", y, ref)
gy = torch.randn_like(y)
gx, gb = torch.autograd.grad(y, (x, b), gy)
rx, rb = torch.autograd.grad(ref, (x, b), gy)
close("bias_gelu grad x", gx, rx)
close("bias_gelu grad bias", gb, rb)

# softmax cross-entropy with label smoothing
logits = torch.randn(16, 10, requires_grad=True)
target = torch.randint(0, 10, (16,))
loss = ops.softmax_xent(logits, target, 0.1)
ref = F.cross_entropy(logits, target, label_smoothing=0.1, reduction="none")
close("softmax_xent forward", loss, ref)
(g,) = torch.autograd.grad(loss.sum(), logits)
(r,) = torch.autograd.grad(ref.sum(), logits)
close("softmax_xent grad", g, r)

# Swish-beta
beta = torch.tensor([1.3], requires_grad=True)
y = ops.swish(x, beta)
ref = x * torch.sigmoid(beta * x)
close("swish forward", y, ref)
gx, gbeta = torch.autograd.grad(y, (x, beta), gy)
rx, rbeta = torch.autograd.grad(ref, (x, beta), gy)
close("swish grad x", gx, rx)
close("swish grad beta", gbeta, rbeta, 1e-4)

# float64 gradcheck against finite differences
d = dict(dtype=torch.float64, requires_grad=True)
assert torch.autograd.gradcheck(ops.bias_gelu, (torch.randn(3, 5, **d), torch.randn(5, **d)))
assert torch.autograd.gradcheck(
    lambda z: ops.softmax_xent(z, torch.tensor([1, 0, 3]), 0.2), (torch.randn(3, 4, **d),)
)
assert torch.autograd.gradcheck(ops.swish, (torch.randn(3, 5, **d), torch.tensor([0.7], **d)))
print("gradcheck: ok")


class Head(torch.nn.Module):
    """Linear -> fused bias+GELU -> Swish-beta -> Linear, and the fused loss."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 32, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(32) * 0.1)
        self.beta = torch.nn.Parameter(torch.tensor([1.5]))
        self.out = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        h = torch.ops.kiln.bias_gelu(self.proj(x), self.bias)
        h = torch.ops.kiln.swish(h, self.beta)
        logits = self.out(h)
        loss = torch.ops.kiln.softmax_xent(logits, target, 0.05).mean()
        return logits, loss


model = torch.jit.script(Head())
model.save(f"{out_dir}/model.pt")
x = torch.randn(8, 12)
target = torch.randint(0, 5, (8,))
logits, loss = model(x, target)


def t(v):
    return {"shape": list(v.shape), "data": v.detach().reshape(-1).tolist()}


with open(f"{out_dir}/io.json", "w") as f:
    json.dump({"x": t(x), "target": t(target), "logits": t(logits), "loss": t(loss)}, f)
print("scripted: ok")
