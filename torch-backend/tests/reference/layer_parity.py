"""Reference for kiln-torch's layer parity tests: forward outputs and gradients of the
torch.nn modules equivalent to Kiln layer definitions.

Usage: python layer_parity.py CASES.json OUT_DIR [DEVICE]

CASES.json is a list of {"name", "layer": <kiln Layer as JSON>, "input": [dims],
"input_dtype": "float32" | "int64", "high": int (int64 inputs draw from [0, high)),
"train": bool, "seed": int, "dtype": "float32" | "bfloat16" (optional, float32 by default:
the module's floating-point parameters and a float input in that dtype), "autocast":
"bfloat16" (optional: the forward pass under `torch.autocast(DEVICE_TYPE, dtype=torch.bfloat16)`,
a floating-point output cast back to float32, as Kiln's `bf16-mixed` precision does)}.
The module and tensors are drawn on the CPU (the same numbers for every device), and the
forward and backward passes run on DEVICE ("cpu" by default, or "cuda:0"): CUDA's kernels
and autocast op lists are not the CPU's, so a GPU run is checked against PyTorch on the GPU.
For each case OUT_DIR/<name>.safetensors holds:

    state.<key>   the module's state_dict before the forward pass
    input         the input
    weight        w in the scalar loss sum(output * w)
    output        the forward output
    grad.input    d loss / d input (float inputs only)
    grad.<param>  d loss / d parameter
    after.<key>   the state_dict after the forward pass (running statistics)

The modules are built by platform-core's model_specs.py, the reference for Kiln layers.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "platform-core", "tests", "reference"))
from model_specs import build  # noqa: E402


def run_case(case, out_dir, device):
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case.get("dtype", "float32"))
    model = build(case["layer"]).to(dtype)
    # Norms' scales moved off the constant torch starts them at (1, or Gemma's 0), so
    # that the order of a norm's scaling and its cast back, which agree at 1, is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] == "weight" and p.dim() == 1 and bool((p == p[0]).all()):
                p.add_(torch.empty_like(p).uniform_(-0.25, 0.25))
    model.train(case["train"])
    state = {f"state.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if case.get("input_dtype") == "int64":
        x = torch.randint(0, case["high"], case["input"], dtype=torch.int64)
    else:
        x = torch.randn(case["input"], dtype=torch.float32).to(dtype)
    model = model.to(device)
    x = x.to(device)
    if x.is_floating_point():
        x.requires_grad_(True)
    if case.get("autocast"):
        with torch.autocast(device.type, dtype=getattr(torch, case["autocast"])):
            out = model(x)
        if out.is_floating_point():
            out = out.float()
    else:
        out = model(x)
    w = torch.randn(out.shape, dtype=out.dtype).to(device)
    (out * w).sum().backward()
    tensors = dict(state)
    tensors["input"] = x.detach().clone()
    tensors["weight"] = w
    tensors["output"] = out.detach().clone()
    if x.is_floating_point():
        tensors["grad.input"] = x.grad.clone()
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors[f"grad.{name}"] = p.grad.clone()
    for k, v in model.state_dict().items():
        tensors[f"after.{k}"] = v.detach().clone().contiguous()
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, case["name"] + ".safetensors"))


def main():
    cases_path, out_dir = sys.argv[1], sys.argv[2]
    device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    with open(cases_path) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    for case in cases:
        run_case(case, out_dir, device)


if __name__ == "__main__":
    main()
