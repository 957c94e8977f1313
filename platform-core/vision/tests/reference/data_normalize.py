"""Reference for kiln_core::Normalize: what torchvision.transforms.Normalize computes.

Usage: python data_normalize.py

torchvision's Normalize on a tensor is
    mean = torch.as_tensor(mean, dtype=x.dtype); std = torch.as_tensor(std, dtype=x.dtype)
    x.sub(mean[:, None, None]).div(std[:, None, None])
which needs only torch, so torchvision is not imported.

Prints one JSON object {"cases": [{"name", "dtype", "shape", "mean", "std", "input", "output"}]}
with the input and output flattened row-major; float32 values are written as the exact
doubles they hold.
"""

import json

import torch


def normalize(x, mean, std):
    mean = torch.as_tensor(mean, dtype=x.dtype)
    std = torch.as_tensor(std, dtype=x.dtype)
    return x.sub(mean[:, None, None]).div(std[:, None, None])


def case(name, x, mean, std):
    y = normalize(x, mean, std)
    return {
        "name": name,
        "dtype": str(x.dtype).removeprefix("torch."),
        "shape": list(x.shape),
        "mean": mean,
        "std": std,
        "input": x.flatten().tolist(),
        "output": y.flatten().tolist(),
    }


def main():
    g = torch.Generator().manual_seed(20240607)
    image = torch.rand(3, 5, 4, generator=g)
    batch = torch.randn(2, 3, 4, 6, generator=g) * 2.0 + 0.5
    # MNIST's and ImageNet's statistics: not exactly representable in float32
    cases = [
        case("mnist_one_channel", torch.rand(1, 6, 7, generator=g), [0.1307], [0.3081]),
        case("imagenet_image", image, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        case("imagenet_batch", batch, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        case("float64_batch", batch.double(), [-1.5, 0.25, 3.0], [0.7, 1.9, 0.05]),
        case("one_value_for_all_channels", image, [0.5], [0.25]),
    ]
    print(json.dumps({"cases": cases}))


if __name__ == "__main__":
    main()
