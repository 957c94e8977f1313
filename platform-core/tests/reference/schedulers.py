"""Reference learning rates from torch.optim.lr_scheduler for kiln_core's schedulers.

Usage: python schedulers.py

Each case is a Kiln SchedulerConfig (as JSON, with only the fields a person would
write; omitted fields take PyTorch's defaults on both sides). The script builds the
PyTorch scheduler for an SGD optimizer with two parameter groups (base learning rates
BASE_LRS), then runs STEPS epochs of `optimizer.step(); scheduler.step()` (or
`scheduler.step(metric)` for ReduceLROnPlateau, fed a fixed metric sequence).

Prints one JSON object:

    {"base_lrs": [...], "steps": N,
     "cases": [{"name", "config", "metrics": [...] | null,
                "lrs": [[lr per group] after 0..N steps],
                "momentums": [[momentum per group] after 0..N steps] | null}]}
"""

import json
import warnings

import torch
from torch.optim import lr_scheduler

BASE_LRS = [0.1, 0.03]
STEPS = 50


def min_metrics():
    # A loss that improves every 9 epochs and wiggles slightly in between, so that
    # patience runs out, reductions happen and cooldowns start and end.
    out, level = [], 1.0
    for t in range(STEPS):
        if t % 9 == 0:
            level *= 0.8
        out.append(level * (1 + 0.002 * ((t * 5) % 3)))
    return out


def max_metrics():
    # An accuracy that rises every 7 epochs.
    out, level = [], 0.5
    for t in range(STEPS):
        if t % 7 == 0:
            level += 0.06
        out.append(level - 0.01 * ((t * 3) % 4))
    return out


CASES = [
    ("step_lr", {"type": "step_lr", "step_size": 7, "gamma": 0.5}, None),
    ("step_lr_default_gamma", {"type": "step_lr", "step_size": 4}, None),
    ("multi_step_lr", {"type": "multi_step_lr", "milestones": [30, 5, 12, 12], "gamma": 0.3}, None),
    ("exponential_lr", {"type": "exponential_lr", "gamma": 0.93}, None),
    ("cosine_annealing_lr", {"type": "cosine_annealing_lr", "t_max": 15, "eta_min": 0.001}, None),
    ("cosine_annealing_lr_zero_min", {"type": "cosine_annealing_lr", "t_max": 20}, None),
    ("warm_restarts_mult2", {"type": "cosine_annealing_warm_restarts", "t_0": 5, "t_mult": 2, "eta_min": 0.0005}, None),
    ("warm_restarts_mult1", {"type": "cosine_annealing_warm_restarts", "t_0": 7}, None),
    ("linear_warmup", {"type": "linear_lr", "start_factor": 0.25, "end_factor": 1.0, "total_iters": 10}, None),
    ("linear_decay", {"type": "linear_lr", "start_factor": 1.0, "end_factor": 0.05, "total_iters": 30}, None),
    ("linear_default", {"type": "linear_lr"}, None),
    ("one_cycle_cos", {"type": "one_cycle_lr", "max_lr": [0.5, 0.2], "total_steps": 50}, None),
    ("one_cycle_linear_three_phase",
     {"type": "one_cycle_lr", "max_lr": 0.4, "total_steps": 60, "pct_start": 0.25, "anneal_strategy": "linear",
      "three_phase": True, "div_factor": 10.0, "final_div_factor": 100.0, "base_momentum": 0.8,
      "max_momentum": [0.9, 0.95]}, None),
    ("plateau_min_rel",
     {"type": "reduce_lr_on_plateau", "factor": 0.5, "patience": 2, "cooldown": 2, "threshold": 0.01,
      "min_lr": [0.01, 0.001]}, min_metrics()),
    ("plateau_max_abs",
     {"type": "reduce_lr_on_plateau", "mode": "max", "threshold_mode": "abs", "threshold": 0.05,
      "factor": 0.3, "patience": 1, "cooldown": 1, "min_lr": 0.0005, "eps": 1e-4}, max_metrics()),
    ("plateau_default", {"type": "reduce_lr_on_plateau"}, min_metrics()),
]

RENAMES = {"t_max": "T_max", "t_0": "T_0", "t_mult": "T_mult"}


def build(optimizer, config):
    kwargs = {RENAMES.get(k, k): v for k, v in config.items() if k != "type"}
    kind = config["type"]
    cls = {
        "step_lr": lr_scheduler.StepLR,
        "multi_step_lr": lr_scheduler.MultiStepLR,
        "exponential_lr": lr_scheduler.ExponentialLR,
        "cosine_annealing_lr": lr_scheduler.CosineAnnealingLR,
        "cosine_annealing_warm_restarts": lr_scheduler.CosineAnnealingWarmRestarts,
        "linear_lr": lr_scheduler.LinearLR,
        "one_cycle_lr": lr_scheduler.OneCycleLR,
        "reduce_lr_on_plateau": lr_scheduler.ReduceLROnPlateau,
    }[kind]
    return cls(optimizer, **kwargs)


def run(config, metrics):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in BASE_LRS]
    optimizer = torch.optim.SGD(
        [{"params": [p], "lr": lr} for p, lr in zip(params, BASE_LRS)], lr=BASE_LRS[0], momentum=0.9
    )
    scheduler = build(optimizer, config)
    track_momentum = config["type"] == "one_cycle_lr"

    def record():
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        if track_momentum:
            momentums.append([float(g["momentum"]) for g in optimizer.param_groups])

    lrs, momentums = [], []
    record()
    for t in range(STEPS):
        optimizer.step()
        if metrics is None:
            scheduler.step()
        else:
            scheduler.step(metrics[t])
        record()
    return lrs, (momentums if track_momentum else None)


def main():
    warnings.simplefilter("ignore")
    cases = []
    for name, config, metrics in CASES:
        lrs, momentums = run(config, metrics)
        cases.append({"name": name, "config": config, "metrics": metrics, "lrs": lrs, "momentums": momentums})
    print(json.dumps({"base_lrs": BASE_LRS, "steps": STEPS, "cases": cases}))


if __name__ == "__main__":
    main()
