"""Reference for tests/weight_averaging.rs: the same training run in PyTorch, with
torch.optim.swa_utils.AveragedModel keeping the exponential moving average.

Usage: weight_averaging.py DIR DECAY EVERY START WARMUP BUFFERS EPOCHS BATCH

DIR holds init.safetensors (the model's initial state, Kiln's names) and
data.safetensors (x float32 [N, 4], y int64 [N]). The model is Linear(4, 8),
BatchNorm1d(8), ReLU, Linear(8, 3), trained with SGD (lr 0.1, momentum 0.9) on
cross-entropy over the batches in order. After optimizer step s (1-based), when
s >= START and s % EVERY == 0, AveragedModel.update_parameters runs; its
multi_avg_fn is get_ema_multi_avg_fn's lerp, with timm's warm-up of the decay
when WARMUP is 1. Writes DIR/out.safetensors: `averaged.NAME` (the average's
floating-point tensors) and `model.NAME` (the trained model's).
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from torch.optim.swa_utils import AveragedModel


def main():
    d, decay, every, start, warmup, buffers, epochs, batch = sys.argv[1:]
    decay, every, start, epochs, batch = float(decay), int(every), int(start), int(epochs), int(batch)
    warmup, buffers = warmup == "1", buffers == "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]

    def ema(averaged, current, num_averaged):
        # AveragedModel groups tensors by dtype: batch norm's integer
        # num_batches_tracked is left alone (Kiln averages floating point only).
        if not averaged[0].is_floating_point():
            return
        n = int(num_averaged)
        rate = min(decay, (1 + n) / (10 + n)) if warmup else decay
        torch._foreach_lerp_(averaged, current, 1 - rate)

    averaged = AveragedModel(model, multi_avg_fn=ema, use_buffers=buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = 0
    for _ in range(epochs):
        model.train()
        for i in range(0, x.shape[0], batch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i : i + batch]), y[i : i + batch])
            loss.backward()
            opt.step()
            step += 1
            if step >= start and step % every == 0:
                averaged.update_parameters(model)
    out = {}
    for name, t in averaged.module.state_dict().items():
        if t.is_floating_point():
            out[f"averaged.{name}"] = t.detach().clone().contiguous()
    for name, t in model.state_dict().items():
        out[f"model.{name}"] = t.detach().clone().contiguous()
    out["updates"] = averaged.n_averaged.detach().clone().reshape(1)
    save_file(out, f"{d}/out.safetensors")


if __name__ == "__main__":
    main()
