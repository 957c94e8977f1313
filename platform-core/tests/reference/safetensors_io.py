"""Reference safetensors files for kiln_core's StateDict::{save,load}_safetensors.

Usage:
    python safetensors_io.py write PATH       write known tensors with safetensors.torch.save_file
    python safetensors_io.py write-f8 PATH    write a file holding a float8 (e4m3) tensor
    python safetensors_io.py read PATH        read PATH with safetensors.torch.load_file

`write` and `read` print the tensors as JSON:

    {"tensors": {name: {"dtype": "float32", "shape": [...], "values": [flat values]}},
     "metadata": {key: value}}
"""

import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def describe(tensors, metadata):
    out = {}
    for name, t in tensors.items():
        out[name] = {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "values": t.flatten().tolist(),
        }
    return {"tensors": out, "metadata": metadata or {}}


def known_tensors():
    return {
        "encoder.layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.25 - 1.0,
        "encoder.layer.bias": torch.tensor([1.0 / 3.0, -2.5e-8, 3.0e38], dtype=torch.float32),
        "head.double": torch.tensor([[1.0 / 7.0], [-1e-300]], dtype=torch.float64),
        "counts": torch.tensor([[2**40, -5], [0, -(2**62)]], dtype=torch.int64),
        "ids": torch.tensor([7, -3, 2**31 - 1, -(2**31), 0], dtype=torch.int32),
        "mask": torch.tensor([[0, 1, 255], [128, 2, 3]], dtype=torch.uint8),
        "step": torch.tensor(42, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "half.bf16": torch.tensor([[1.0, -0.3125], [3.0e38, 1e-30]], dtype=torch.bfloat16),
        "half.f16": torch.tensor([1.0, -0.3125, 65504.0, 6e-8], dtype=torch.float16),
    }


def main():
    command, path = sys.argv[1], sys.argv[2]
    if command == "write":
        tensors = known_tensors()
        metadata = {"format": "pt", "epoch": "3", "note": "written by safetensors.torch"}
        save_file(tensors, path, metadata=metadata)
        print(json.dumps(describe(tensors, metadata)))
    elif command == "write-f8":
        save_file({"weights": torch.ones(2, 2).to(torch.float8_e4m3fn)}, path)
    elif command == "read":
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        print(json.dumps(describe(tensors, metadata)))
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
