"""Reference for the fused ops' float64 forward (cpp/tests/tensorflow_ops.rs): each
op as PyTorch's composition of built-in ops, in float64, without Kiln's library.

Usage: python fused_ops_float64.py CASES.json

CASES.json is a list of {"op": "bias_gelu" | "softmax_xent" | "swish", "inputs": [T, ...],
"target": T (softmax_xent), "label_smoothing": float (softmax_xent)}, where T is
{"shape": [...], "data": [flat values]}. Prints a JSON list with each case's output
as a T, float64:

    bias_gelu(x, bias)        z * (1 + erf(z / sqrt 2)) / 2, z = x + bias (exact GELU)
    softmax_xent(logits, t)   -(1 - eps) log_softmax(logits)[t] - eps * mean(log_softmax(logits)),
                              per row (cross-entropy with label smoothing eps)
    swish(x, beta)            x * sigmoid(beta * x)

Each is also checked against torch.nn.functional's own op (gelu, cross_entropy), so a
wrong formula here fails here.
"""

import json
import math
import sys

import torch
import torch.nn.functional as F


def tensor(t, dtype=torch.float64):
    return torch.tensor(t["data"], dtype=dtype).reshape(t["shape"])


def bias_gelu(x, bias):
    z = x + bias
    y = 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
    check("bias_gelu", y, F.gelu(z))
    return y


def softmax_xent(logits, target, eps):
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    y = -(1.0 - eps) * picked - eps * logp.mean(dim=-1)
    expected = F.cross_entropy(logits, target, label_smoothing=eps, reduction="none")
    check("softmax_xent", y, expected)
    return y


def swish(x, beta):
    return x * torch.sigmoid(beta * x)


def check(name, y, expected):
    err = (y - expected).abs().max().item() if y.numel() else 0.0
    assert err < 1e-13, f"{name}: the composition differs from torch.nn.functional by {err}"


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    outputs = []
    for case in cases:
        inputs = [tensor(t) for t in case["inputs"]]
        op = case["op"]
        if op == "bias_gelu":
            y = bias_gelu(*inputs)
        elif op == "softmax_xent":
            target = tensor(case["target"], torch.int64)
            y = softmax_xent(inputs[0], target, case["label_smoothing"])
        elif op == "swish":
            y = swish(*inputs)
        else:
            raise ValueError(f"unknown op {op!r}")
        assert y.dtype == torch.float64, y.dtype
        outputs.append({"shape": list(y.shape), "data": y.flatten().tolist()})
    json.dump(outputs, sys.stdout)


if __name__ == "__main__":
    main()
