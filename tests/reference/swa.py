"""Reference for tests/trainer/swa.rs: the same training run in PyTorch with
stochastic weight averaging as the torch.optim.swa_utils recipe (and Lightning's
StochasticWeightAveraging) runs it.

Usage: swa.py DIR SWA_LR START ANNEAL STRATEGY EPOCHS BATCH GAMMA

DIR holds init.safetensors (the model's initial state, Kiln's names) and
data.safetensors (x float32 [N, 4], y int64 [N]). The model is Linear(4, 8),
BatchNorm1d(8), ReLU, Linear(8, 3), trained with SGD (lr 0.1, momentum 0.9) on
cross-entropy over the batches in order, with StepLR(step_size=1, gamma=GAMMA)
stepped after each epoch before SWA begins (none when GAMMA is 0). At the start
of epoch START (0-based) SWALR(swa_lr=SWA_LR, anneal_epochs=ANNEAL,
anneal_strategy=STRATEGY) takes over; after each epoch from START on,
AveragedModel (equal weights, parameters only) updates and SWALR steps. At the
end, update_bn recomputes the average's batch-norm statistics over the batches.
Writes DIR/out.safetensors: `averaged.NAME` (the average's state after
update_bn), `parameters.NAME` (its parameters before), `model.NAME` (the
trained model's state), `lrs` (each epoch's rate) and `updates`.
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn


def main():
    d, swa_lr, start, anneal, strategy, epochs, batch, gamma = sys.argv[1:]
    swa_lr, start, anneal = float(swa_lr), int(start), int(anneal)
    epochs, batch, gamma = int(epochs), int(batch), float(gamma)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, x.shape[0], batch)]

    averaged = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma) if gamma > 0 else None
    swa_schedule = None
    lrs = []
    for epoch in range(epochs):
        if epoch == start:
            swa_schedule = SWALR(opt, swa_lr=swa_lr, anneal_epochs=anneal, anneal_strategy=strategy)
        lrs.append(opt.param_groups[0]["lr"])
        model.train()
        for xb, yb in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        if epoch >= start:
            averaged.update_parameters(model)
            swa_schedule.step()
        elif schedule is not None:
            schedule.step()
    out = {}
    for name, t in averaged.module.named_parameters():
        out[f"parameters.{name}"] = t.detach().clone().contiguous()
    update_bn([xb for xb, _ in batches], averaged)
    for name, t in averaged.module.state_dict().items():
        out[f"averaged.{name}"] = t.detach().clone().contiguous()
    for name, t in model.state_dict().items():
        out[f"model.{name}"] = t.detach().clone().contiguous()
    out["lrs"] = torch.tensor(lrs, dtype=torch.float64)
    out["updates"] = averaged.n_averaged.detach().clone().reshape(1)
    save_file(out, f"{d}/out.safetensors")


if __name__ == "__main__":
    main()
