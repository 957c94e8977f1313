"""Reference for tests/trainer/objective.rs: knowledge distillation trained in PyTorch
as Kiln's Trainer trains the `Distillation` objective.

Usage: distillation.py DIR TEMPERATURE ALPHA EPOCHS BATCH ACCUMULATE

DIR holds student.safetensors and teacher.safetensors (initial states, Kiln's
names), train.safetensors and val.safetensors (x float32 [N, 4], y int64 [N]).
Student: Linear(4, 6), ReLU, Linear(6, 3); teacher: Linear(4, 8), ReLU,
Linear(8, 3), frozen in eval mode. Loss per micro-batch:
alpha * T^2 * kl_div(log_softmax(s / T), log_softmax(t / T), batchmean, log_target)
+ (1 - alpha) * cross_entropy(s, y), its gradient divided by ACCUMULATE and
accumulated over ACCUMULATE micro-batches before each SGD step (lr 0.2,
momentum 0.9). Writes DIR/out.safetensors: `model.NAME` (the trained
student) and, for each epoch E, `E.loss`, `E.distill_kl`, `E.hard_loss` (the
epoch's row-weighted means over its micro-batches) and `E.val_loss`,
`E.val_distill_kl`, `E.val_hard_loss`, `E.val_accuracy` on the validation set
after the epoch, in eval mode.
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def mlp(hidden):
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def main():
    d, temperature, alpha, epochs, batch, accumulate = sys.argv[1:]
    t, alpha, epochs, batch, accumulate = float(temperature), float(alpha), int(epochs), int(batch), int(accumulate)
    student, teacher = mlp(6), mlp(8)
    student.load_state_dict(load_file(f"{d}/student.safetensors"))
    teacher.load_state_dict(load_file(f"{d}/teacher.safetensors"))
    teacher.eval()
    train, val = load_file(f"{d}/train.safetensors"), load_file(f"{d}/val.safetensors")
    opt = torch.optim.SGD(student.parameters(), lr=0.2, momentum=0.9)

    def terms(x, y):
        s = student(x)
        with torch.no_grad():
            teacher_logits = teacher(x)
        kl = F.kl_div(F.log_softmax(s / t, -1), F.log_softmax(teacher_logits / t, -1),
                      reduction="batchmean", log_target=True)
        hard = F.cross_entropy(s, y)
        return alpha * t * t * kl + (1 - alpha) * hard, kl, hard, s

    out = {}
    x, y = train["x"], train["y"]
    for epoch in range(epochs):
        student.train()
        sums, rows = torch.zeros(3, dtype=torch.float64), 0
        for i, start in enumerate(range(0, x.shape[0], batch)):
            xb, yb = x[start:start + batch], y[start:start + batch]
            if i % accumulate == 0:
                opt.zero_grad()
            loss, kl, hard, _ = terms(xb, yb)
            (loss / accumulate).backward()
            if (i + 1) % accumulate == 0:
                opt.step()
            sums += torch.tensor([loss.item(), kl.item(), hard.item()], dtype=torch.float64) * xb.shape[0]
            rows += xb.shape[0]
        for name, v in zip(["loss", "distill_kl", "hard_loss"], sums / rows):
            out[f"{epoch}.{name}"] = v.reshape(1)
        student.eval()
        with torch.no_grad():
            sums, rows, correct = torch.zeros(3, dtype=torch.float64), 0, 0
            vx, vy = val["x"], val["y"]
            for start in range(0, vx.shape[0], batch):
                xb, yb = vx[start:start + batch], vy[start:start + batch]
                loss, kl, hard, s = terms(xb, yb)
                sums += torch.tensor([loss.item(), kl.item(), hard.item()], dtype=torch.float64) * xb.shape[0]
                rows += xb.shape[0]
                correct += int((s.argmax(-1) == yb).sum())
        for name, v in zip(["val_loss", "val_distill_kl", "val_hard_loss"], sums / rows):
            out[f"{epoch}.{name}"] = v.reshape(1)
        out[f"{epoch}.val_accuracy"] = torch.tensor([correct / rows], dtype=torch.float64)
    for name, p in student.state_dict().items():
        out[f"model.{name}"] = p.detach().clone().contiguous()
    save_file(out, f"{d}/out.safetensors")


if __name__ == "__main__":
    main()
