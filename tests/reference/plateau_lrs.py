"""PyTorch's ReduceLROnPlateau fed a metric sequence: the learning rate after each step.

Usage: python plateau_lrs.py '{"lr": 0.003, "mode": "max", "patience": 1, "factor": 0.5,
                               "cooldown": 1, "threshold": 0.0, "metrics": [...]}'
Prints a JSON list with one rate per metric.
"""

import json
import sys

import torch

spec = json.loads(sys.argv[1])
param = torch.nn.Parameter(torch.zeros(1))
optimizer = torch.optim.SGD([param], lr=spec["lr"])
scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
    optimizer,
    mode=spec["mode"],
    factor=spec["factor"],
    patience=spec["patience"],
    cooldown=spec["cooldown"],
    threshold=spec["threshold"],
)
rates = []
for metric in spec["metrics"]:
    scheduler.step(metric)
    rates.append(optimizer.param_groups[0]["lr"])
print(json.dumps(rates))
