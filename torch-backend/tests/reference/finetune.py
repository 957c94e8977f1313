"""Fine-tuning a scripted backbone with batch norm, for kiln-torch's
tests/finetune.rs: the PyTorch side of the same run.

Usage:
    python finetune.py make DIR
        writes DIR/backbone.pt (torch.jit.script of Linear(6, 8) + BatchNorm1d(8)
        + ReLU, with non-trivial running statistics) and DIR/data.safetensors
        (x: float32 [48, 6], y: int64 [48], 3 classes).
    python finetune.py train DIR BN_MODE
        loads DIR/backbone.pt with torch.jit.load, freezes its parameters
        (requires_grad_(False)), puts its batch norm in eval mode when BN_MODE is
        "eval" (else leaves it training), adds nn.Linear(8, 3) with the weights in
        DIR/head.safetensors (`weight`, `bias`: Kiln's initial head), and trains
        the head with SGD(lr=0.1, momentum=0.9) on cross-entropy, batches of 16 in
        order, 2 epochs. Writes DIR/python_<BN_MODE>.safetensors: `losses`
        (float64, one per step), `head.weight`, `head.bias` and `backbone.<name>`
        for every entry of the backbone's final state dict.
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


def make(out_dir):
    torch.manual_seed(7)
    backbone = torch.jit.script(Backbone())
    with torch.no_grad():
        for _ in range(4):
            backbone(torch.randn(32, 6) * 1.5 + 0.5)
    backbone.save(os.path.join(out_dir, "backbone.pt"))
    x = torch.randn(48, 6)
    y = torch.randint(0, 3, (48,))
    save_file({"x": x, "y": y}, os.path.join(out_dir, "data.safetensors"))


def train(out_dir, bn_mode):
    torch.manual_seed(0)
    backbone = torch.jit.load(os.path.join(out_dir, "backbone.pt"))
    for p in backbone.parameters():
        p.requires_grad_(False)
    head = nn.Linear(8, 3)
    init = load_file(os.path.join(out_dir, "head.safetensors"))
    with torch.no_grad():
        head.weight.copy_(init["weight"])
        head.bias.copy_(init["bias"])
    data = load_file(os.path.join(out_dir, "data.safetensors"))
    x, y = data["x"], data["y"]
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _epoch in range(2):
        backbone.train()
        if bn_mode == "eval":
            backbone.bn.eval()
        head.train()
        for start in range(0, 48, 16):
            xb, yb = x[start:start + 16], y[start:start + 16]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(head(backbone(xb)), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    out = {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "head.weight": head.weight.detach(),
        "head.bias": head.bias.detach(),
    }
    for name, value in backbone.state_dict().items():
        out[f"backbone.{name}"] = value
    save_file({k: v.contiguous() for k, v in out.items()},
              os.path.join(out_dir, f"python_{bn_mode}.safetensors"))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        train(sys.argv[2], sys.argv[3])
