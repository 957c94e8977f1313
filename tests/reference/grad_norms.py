"""Reference for tests/trainer/step_views.rs: the gradient norms and learning
rates TensorBoard's views show, from the same run in PyTorch.

Usage: grad_norms.py DIR STEPS BATCH MAX_NORM

DIR holds init.safetensors (the model's initial state, Kiln's names) and
data.safetensors (x float32 [N, 4], y int64 [N]). The model is Linear(4, 8),
BatchNorm1d(8), ReLU, Linear(8, 3), trained with SGD (momentum 0.9) in two
parameter groups, `0.*` at lr 0.05 and the rest at 0.1, on cross-entropy over
the batches in order, with clip_grad_norm_(MAX_NORM) before each step. Writes
DIR/out.safetensors: `norms` [STEPS, 2], each group's gradient L2 norm as the
step applied it (after clipping), and `weights.NAME`, the trained parameters.
"""

import sys

import torch
from safetensors.torch import load_file, save_file


def main():
    d, steps, batch, max_norm = sys.argv[1:]
    steps, batch, max_norm = int(steps), int(batch), float(max_norm)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    opt = torch.optim.SGD(
        [{"params": first, "lr": 0.05}, {"params": rest, "lr": 0.1}], lr=0.1, momentum=0.9
    )
    norms = []
    model.train()
    for step in range(steps):
        i = (step * batch) % x.shape[0]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + batch]), y[i : i + batch]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norms.append(
            [torch.stack([p.grad.norm() for p in group]).norm().item() for group in (first, rest)]
        )
        opt.step()
    out = {"norms": torch.tensor(norms, dtype=torch.float64)}
    for name, t in model.named_parameters():
        out[f"weights.{name}"] = t.detach().clone().contiguous()
    save_file(out, f"{d}/out.safetensors")


if __name__ == "__main__":
    main()
