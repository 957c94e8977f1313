"""Fixtures for kiln-torch's TorchScript tests, made by Python PyTorch.

Usage:
    python torchscript_models.py make OUT_DIR
        writes mlp_bn.pt (scripted, with BatchNorm), multi_io.pt (two inputs, a tuple
        out), dict_out.pt (a dict out), traced_cnn.pt (torch.jit.trace), not_script.pt
        (a state_dict saved with torch.save) and reference.safetensors with inputs
        and the outputs of each model in eval and train mode.
    python torchscript_models.py run MODEL.pt INPUT.safetensors OUT.safetensors
        loads MODEL.pt with torch.jit.load, runs it in eval mode on `x` and writes `y`
        and the model's state dict, parameters and buffers (`state.<name>`).
"""

import os
import sys
from typing import Dict, Tuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class MlpBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class MultiIo(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.proj(a) + b, (a * b).sum(-1)


class DictOut(nn.Module):
    def forward(self, x) -> Dict[str, torch.Tensor]:
        return {"double": 2 * x, "total": x.sum()}


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def make(out_dir):
    torch.manual_seed(0)
    mlp = torch.jit.script(MlpBn())
    # Give BatchNorm non-trivial running statistics before saving.
    with torch.no_grad():
        for _ in range(3):
            mlp(torch.randn(16, 4) * 2 + 1)
    mlp.save(os.path.join(out_dir, "mlp_bn.pt"))
    multi = torch.jit.script(MultiIo())
    multi.save(os.path.join(out_dir, "multi_io.pt"))
    torch.jit.script(DictOut()).save(os.path.join(out_dir, "dict_out.pt"))
    cnn = Cnn().eval()
    traced = torch.jit.trace(cnn, torch.randn(2, 1, 8, 8))
    traced.save(os.path.join(out_dir, "traced_cnn.pt"))
    torch.save(MlpBn().state_dict(), os.path.join(out_dir, "not_script.pt"))

    x = torch.randn(6, 4)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    img = torch.randn(3, 1, 8, 8)
    ref = {"x": x, "a": a, "b": b, "img": img}
    with torch.no_grad():
        mlp.eval()
        ref["mlp_eval"] = mlp(x)
        loaded = torch.jit.load(os.path.join(out_dir, "mlp_bn.pt"))
        loaded.train()
        ref["mlp_train"] = loaded(x)
        ref["multi_0"], ref["multi_1"] = multi(a, b)
        ref["cnn"] = traced(img)
    for name, value in torch.jit.load(os.path.join(out_dir, "mlp_bn.pt")).state_dict().items():
        ref[f"mlp_state.{name}"] = value
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out_dir, "reference.safetensors"))


def run(model_path, input_path, out_path):
    model = torch.jit.load(model_path)
    model.eval()
    x = load_file(input_path)["x"]
    with torch.no_grad():
        y = model(x)
    out = {"y": y}
    for name, p in model.state_dict().items():
        out[f"state.{name}"] = p.detach().clone()
    save_file({k: v.contiguous() for k, v in out.items()}, out_path)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4])
