"""A pretrained-backbone stand-in for tests/cli_finetune.rs.

Usage: python torchscript_backbone.py OUT.pt

Writes torch.jit.script of Conv2d(1, 4, 3, padding=1) + BatchNorm2d(4) + ReLU +
flatten (seed 0, untrained): 256 features from a [N, 1, 8, 8] digit.
"""

import sys

import torch


class Backbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).flatten(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.jit.script(Backbone()).save(sys.argv[1])
