"""Reference for tests/trainer/lr_finder.rs: Lightning's learning-rate range test
(`Tuner.lr_find`) on the model of weight_averaging.py, written out in PyTorch.

Usage: lr_finder.py DIR MIN_LR MAX_LR NUM MODE THRESHOLD BATCH

DIR holds init.safetensors and data.safetensors as for weight_averaging.py. The
learning rate of step i is Lightning's _ExponentialLR / _LinearLR schedule (the
first step at MIN_LR, then r = (i + 1) / NUM); the recorded loss is Lightning's
_LRCallback running average with beta 0.98, bias-corrected with the optimizer step
count plus one; the test stops once the smoothed loss exceeds THRESHOLD times the
best (after the first step). The suggestion is Lightning's: the steepest negative
torch.gradient of the losses against the rates, skipping the first 10 steps and the
last; and the same against log10 of the rates. Prints JSON: lrs, losses,
suggestion, suggestion_log.
"""

import json
import sys

import torch
from safetensors.torch import load_file


def main():
    d, min_lr, max_lr, num, mode, threshold, batch = sys.argv[1:]
    min_lr, max_lr, num, threshold, batch = float(min_lr), float(max_lr), int(num), float(threshold), int(batch)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]
    opt = torch.optim.SGD(model.parameters(), lr=min_lr, momentum=0.9)
    beta, avg, best = 0.98, 0.0, 0.0
    lrs, losses = [], []
    model.train()
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, x.shape[0], batch)]
    for i in range(num):
        if i == 0:
            lr = min_lr
        else:
            r = (i + 1) / num
            lr = min_lr * (max_lr / min_lr) ** r if mode == "exponential" else min_lr + r * (max_lr - min_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        xb, yb = batches[i % len(batches)]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        step = i + 1
        avg = beta * avg + (1 - beta) * loss.item()
        smoothed = avg / (1 - beta ** (step + 1))
        lrs.append(lr)
        losses.append(smoothed)
        stop = step > 1 and smoothed > threshold * best
        if smoothed < best or step == 1:
            best = smoothed
        if stop:
            break
    ls, rs = torch.tensor(losses[10:-1], dtype=torch.float64), torch.tensor(lrs[10:-1], dtype=torch.float64)
    finite = torch.isfinite(ls)
    suggestion = suggestion_log = None
    if int(finite.sum()) >= 2:
        indices = torch.arange(len(losses))[10:-1][finite]
        gradients = torch.gradient(ls[finite], spacing=[rs[finite]])[0]
        suggestion = lrs[indices[torch.argmin(gradients)].item()]
        # The same slope against log10 of the rate (Kiln's --suggestion log).
        gradients = torch.gradient(ls[finite], spacing=[torch.log10(rs[finite])])[0]
        suggestion_log = lrs[indices[torch.argmin(gradients)].item()]
    print(json.dumps({"lrs": lrs, "losses": losses, "suggestion": suggestion, "suggestion_log": suggestion_log}))


if __name__ == "__main__":
    main()
