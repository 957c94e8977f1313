"""A stand-in for a pretrained backbone, for Kiln's fine-tuning example.

Trains a small CNN with batch norm on the digits 0-4 only (a task other than the
one it will be fine-tuned for), then exports its feature extractor (convolutions,
batch norm, ReLU, pooling, flatten; without the classifier) with torch.jit.script.
No pretrained weights can be downloaded here; with a real backbone (a torchvision
ResNet, say), script or trace it the same way.

    python examples/finetune/backbone.py backbone.pt [--data .kiln/data/digits.csv.gz]

Use the project virtualenv's Python (.kiln/venv/bin/python). Prints the size of
one example's features, the `in_features` of the head that goes after it.
"""

import argparse
import gzip
import pathlib

import numpy as np
import torch
from torch import nn


class Backbone(nn.Module):
    """[N, 1, 8, 8] -> [N, 32 * 2 * 2] features."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))  # 16 x 4 x 4
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))  # 32 x 2 x 2
        return torch.flatten(x, 1)


def load_digits(path):
    """Kiln's digits file: 64 pixel values (0-16) and the label, per line."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(rows[:, :64] / 16.0).reshape(-1, 1, 8, 8)
    labels = torch.from_numpy(rows[:, 64].astype(np.int64))
    return images, labels


def main():
    root = pathlib.Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to write the TorchScript backbone (.pt)")
    parser.add_argument("--data", default=root / ".kiln/data/digits.csv.gz")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)  # small ops: one thread is fastest, and the same everywhere
    images, labels = load_digits(args.data)
    keep = labels < 5
    images, labels = images[keep], labels[keep]

    backbone = Backbone()
    classifier = nn.Linear(32 * 2 * 2, 5)
    model = nn.Sequential(backbone, classifier)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(labels))
        for batch in order.split(64):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(images).argmax(1) == labels).float().mean().item()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}, accuracy on 0-4 {accuracy:.3f}")

    # Exported in eval mode, as a pretrained model is: torch.jit.load gives a
    # module ready for inference (Kiln switches it to training mode to fine-tune).
    backbone.eval()
    scripted = torch.jit.script(backbone)
    scripted.save(str(args.out))
    features = scripted(torch.zeros(1, 1, 8, 8)).shape[1]
    print(f"backbone saved to {args.out}: [N, 1, 8, 8] -> [N, {features}]")


if __name__ == "__main__":
    main()
