"""Writes Kiln's small image-classification set: rendered shapes, as class folders and as
WebDataset tar shards.

    python examples/images/make_shapes.py OUT [--size 64] [--train-per-class 500]
        [--val-per-class 100] [--shard-size 500] [--seed 0]

OUT/train/<class>/<key>.jpg and OUT/val/<class>/<key>.jpg are what
`torchvision.datasets.ImageFolder` (and Kiln's `ImageFolder`) read; OUT/shards/train-000000.tar
... and OUT/shards/val-000000.tar hold the same images as WebDataset samples (`<key>.jpg` with
`<key>.cls`, the class index as ASCII). Each image is one of six shapes at a random scale (a
quarter to nearly the whole image), position, rotation and colour, on a noisy two-colour
gradient. Most are baseline JPEGs; every 7th is progressive, every 11th grayscale and every 13th
a PNG (RGBA every 26th), so loaders meet each kind. The same arguments give the same bytes.
`cargo xtask setup` writes it to `.kiln/data/shapes`.
"""

import argparse
import io
import math
import os
import sys
import tarfile

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ["circle", "cross", "ring", "square", "star", "triangle"]


def polygon(cx, cy, r, sides, rotation, inner=None):
    points = []
    count = sides * (2 if inner else 1)
    for k in range(count):
        radius = r if inner is None or k % 2 == 0 else r * inner
        angle = rotation + 2 * math.pi * k / count
        points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
    return points


def render(rng, shape, size):
    # Background: a noisy gradient between two random colours.
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0.0, 1.0, size)[None, :, None]
    if rng.random() < 0.5:
        t = t.transpose(1, 0, 2)
    background = c0 * (1 - t) + c1 * t + rng.normal(0, 6, (size, size, 3))
    image = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    # Foreground: far enough from the background's mean to be visible.
    while True:
        fg = tuple(int(v) for v in rng.integers(0, 256, 3))
        if np.abs(np.array(fg) - (c0 + c1) / 2).sum() > 150:
            break
    r = size * rng.uniform(0.12, 0.45)
    cx = rng.uniform(r, size - r)
    cy = rng.uniform(r, size - r)
    rot = rng.uniform(0, 2 * math.pi)
    box = [cx - r, cy - r, cx + r, cy + r]
    width = max(2, int(r / 3))
    if shape == "circle":
        draw.ellipse(box, fill=fg)
    elif shape == "ring":
        draw.ellipse(box, outline=fg, width=width)
    elif shape == "square":
        draw.polygon(polygon(cx, cy, r, 4, rot), fill=fg)
    elif shape == "triangle":
        draw.polygon(polygon(cx, cy, r, 3, rot), fill=fg)
    elif shape == "star":
        draw.polygon(polygon(cx, cy, r, 5, rot, inner=0.45), fill=fg)
    elif shape == "cross":
        for angle in (rot, rot + math.pi / 2):
            dx, dy = r * math.cos(angle), r * math.sin(angle)
            draw.line([(cx - dx, cy - dy), (cx + dx, cy + dy)], fill=fg, width=width)
    return image


def encode(image, serial, rng):
    """The file's bytes and extension; the kind of file depends on its serial number."""
    out = io.BytesIO()
    if serial % 13 == 0:
        if serial % 26 == 0:
            image = image.convert("RGBA")
        image.save(out, "PNG")
        return out.getvalue(), "png"
    if serial % 11 == 0:
        image = image.convert("L")
    quality = int(rng.integers(80, 96))
    image.save(out, "JPEG", quality=quality, progressive=serial % 7 == 0)
    return out.getvalue(), "jpg"


def write_split(out, split, per_class, size, shard_size, rng):
    samples = []
    for serial in range(per_class * len(CLASSES)):
        label = serial % len(CLASSES)
        data, ext = encode(render(rng, CLASSES[label], size), serial, rng)
        key = f"{split}-{serial:06d}"
        folder = os.path.join(out, split, CLASSES[label])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{key}.{ext}"), "wb") as f:
            f.write(data)
        samples.append((key, ext, data, label))
    shards = os.path.join(out, "shards")
    os.makedirs(shards, exist_ok=True)
    for n, start in enumerate(range(0, len(samples), shard_size)):
        path = os.path.join(shards, f"{split}-{n:06d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, ext, data, label in samples[start : start + shard_size]:
                for name, payload in ((f"{key}.{ext}", data), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    info.mtime = 0
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(payload))
    return len(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--train-per-class", type=int, default=500)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"{args.out} exists and is not empty; give a new directory")
    rng = np.random.default_rng(args.seed)
    train = write_split(args.out, "train", args.train_per_class, args.size, args.shard_size, rng)
    val = write_split(args.out, "val", args.val_per_class, args.size, args.shard_size, rng)
    print(f"{train} training and {val} validation images of {args.size}x{args.size} in {args.out}")


if __name__ == "__main__":
    main()
