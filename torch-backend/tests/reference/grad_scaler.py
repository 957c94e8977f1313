"""Reference for kiln-torch's loss-scaling test: float16 autocast on the CPU with
torch.amp.GradScaler, as a PyTorch user writes the loop.

Usage: python grad_scaler.py CASES.json OUT_DIR

CASES.json is a list of {"name", "layer": <kiln Layer>, "optimizer": "sgd" | "adam",
"lr", "momentum", "clip_norm": float | null, "init_scale", "growth_interval", "steps",
"seed", "batch", "inputs", "classes"}. For each case OUT_DIR/<name>.safetensors holds
`initial.<param>`, `x.<k>`, `y.<k>` (the batches), `loss` and `scale` (per step: the
unscaled loss, and the scale after `scaler.update()`), `skipped` (1 where the step
was skipped) and `final.<param>`.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "platform-core", "tests", "reference"))
from model_specs import build  # noqa: E402


def run_case(case, out_dir):
    torch.manual_seed(case["seed"])
    model = build(case["layer"])
    tensors = {f"initial.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    if case["optimizer"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=case["lr"], momentum=case["momentum"], foreach=False)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=case["lr"], foreach=False)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=case["init_scale"],
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=case["growth_interval"],
    )
    losses, scales, skipped = [], [], []
    for k in range(case["steps"]):
        x = torch.randn(case["batch"], case["inputs"])
        y = torch.randint(0, case["classes"], (case["batch"],))
        tensors[f"x.{k}"], tensors[f"y.{k}"] = x, y
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        if case["clip_norm"] is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip_norm"], foreach=False)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
        skipped.append(1.0 if scaler.get_scale() < before else 0.0)
    tensors["loss"] = torch.tensor(losses, dtype=torch.float64)
    tensors["scale"] = torch.tensor(scales, dtype=torch.float64)
    tensors["skipped"] = torch.tensor(skipped, dtype=torch.float64)
    for k, v in model.state_dict().items():
        tensors[f"final.{k}"] = v.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, case["name"] + ".safetensors"))


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    for case in cases:
        run_case(case, sys.argv[2])


if __name__ == "__main__":
    main()
