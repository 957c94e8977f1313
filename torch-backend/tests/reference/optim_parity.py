"""Reference for kiln-torch's optimizer parity tests: torch.optim on a small MLP.

Usage: python optim_parity.py CASES.json OUT_DIR

CASES.json is a list of {"name", "layer": <kiln Layer>, "optimizer": <kiln OptimizerConfig>,
"groups": [<kiln ParamGroup>], "clip": <kiln GradClip> | null, "steps": int, "seed": int,
"batch": int, "inputs": int, "outputs": int}. For each case OUT_DIR/<name>.safetensors holds
`initial.<param>`, `x.<k>`, `y.<k>` (the batches), `loss` (per step, before the update),
`final.<param>` after `steps` optimizer steps of MSE loss, and `state.<param>.<buffer>`
(the optimizer's per-parameter state at the end).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "platform-core", "tests", "reference"))
from model_specs import build  # noqa: E402


def make_optimizer(config, groups, model):
    kind = config["type"]
    named = list(model.named_parameters())
    taken = set()
    torch_groups = []

    def selects(selector, name):
        if selector == "all":
            return True
        (key, value), = selector.items()
        return {"prefix": name.startswith, "suffix": name.endswith}.get(key, lambda v: name in v)(value)

    for group in groups:
        params = [p for n, p in named if n not in taken and selects(group["params"], n)]
        taken.update(n for n, _ in named if selects(group["params"], n))
        g = {"params": params}
        if group.get("lr") is not None:
            g["lr"] = group["lr"]
        if group.get("weight_decay") is not None:
            g["weight_decay"] = group["weight_decay"]
        torch_groups.append(g)
    rest = [p for n, p in named if n not in taken]
    if rest:
        torch_groups.append({"params": rest})
    c = {k: v for k, v in config.items() if k != "type"}
    if kind == "sgd":
        return torch.optim.SGD(torch_groups, foreach=False, **c)
    if kind == "adam":
        c["betas"] = tuple(c["betas"])
        return torch.optim.Adam(torch_groups, foreach=False, **c)
    if kind == "adamw":
        c["betas"] = tuple(c["betas"])
        return torch.optim.AdamW(torch_groups, foreach=False, **c)
    if kind == "rmsprop":
        return torch.optim.RMSprop(torch_groups, foreach=False, **c)
    if kind == "adagrad":
        return torch.optim.Adagrad(torch_groups, foreach=False, **c)
    raise ValueError(f"unknown optimizer {kind}")


def run_case(case, out_dir):
    torch.manual_seed(case["seed"])
    model = build(case["layer"])
    tensors = {f"initial.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(case["optimizer"], case["groups"], model)
    losses = []
    for k in range(case["steps"]):
        x = torch.randn(case["batch"], case["inputs"])
        y = torch.randn(case["batch"], case["outputs"])
        tensors[f"x.{k}"], tensors[f"y.{k}"] = x, y
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        clip = case.get("clip")
        if clip is not None and clip["type"] == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip["max_norm"], clip["norm_type"], foreach=False)
        elif clip is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip["clip_value"], foreach=False)
        opt.step()
        losses.append(loss.item())
    tensors["loss"] = torch.tensor(losses, dtype=torch.float64)
    for k, v in model.state_dict().items():
        tensors[f"final.{k}"] = v.detach().clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                tensors[f"state.{names[id(p)]}.{key}"] = value.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, case["name"] + ".safetensors"))


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    for case in cases:
        run_case(case, sys.argv[2])


if __name__ == "__main__":
    main()
