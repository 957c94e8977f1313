"""Fixtures and references for kiln-data's image tests (tests/data_image.rs).

Usage: python data_image.py OUT_DIR

Writes under OUT_DIR, with Pillow, the standard library's tarfile and torchvision:

* folder/    an ImageFolder tree (classes with JPEG and PNG files of several sizes, a
             grayscale and an RGBA image, nested and ignored files);
* decode/    JPEG (quality 75 and 95, 4:2:0, 4:2:2 and 4:4:4, progressive, grayscale, odd
             sizes) and PNG (RGB, RGBA, L, LA, P, P with transparency, 1-bit, 16-bit RGB and
             gray) files, and for each the pixels Pillow decodes
             (Image.open(p).convert(mode)) as raw [C, H, W] u8 files *.expected;
* stack/     an ImageFolder of equal-sized images, one of them a truncated JPEG;
* empty/     an ImageFolder with an empty class folder;
* shards/    WebDataset tar shards (samples 8x6 px, `jpg`/`png` + `cls`, one shard labelled
             with `json`), and shards_bad/truncated.tar cut inside a member.

Prints one JSON object describing them: torchvision's ImageFolder class_to_idx and samples,
its error for the empty class, the decode cases, and each shard's samples (key, label) in
file order.
"""

import io
import json
import os
import sys
import tarfile
import warnings

import numpy as np
from PIL import Image

warnings.filterwarnings("ignore")
from torchvision.datasets import ImageFolder  # noqa: E402

OUT = sys.argv[1]
rng = np.random.default_rng(1234)


def picture(h, w, c=3):
    """A smooth gradient with some noise: compresses like a photograph, not like noise."""
    y, x = np.mgrid[0:h, 0:w]
    base = [
        (x * 255 / max(w - 1, 1)),
        (y * 255 / max(h - 1, 1)),
        ((x + y) * 127 / max(w + h - 2, 1) + 64),
        (255 - x * 200 / max(w - 1, 1)),
    ]
    planes = [np.clip(base[i % 4] + rng.normal(0, 18, (h, w)), 0, 255) for i in range(c)]
    arr = np.stack(planes, axis=-1).astype(np.uint8)
    return arr[..., 0] if c == 1 else arr


def chw(im):
    a = np.asarray(im)
    if a.ndim == 2:
        a = a[None]
    else:
        a = a.transpose(2, 0, 1)
    return np.ascontiguousarray(a)


def mkdir(*parts):
    p = os.path.join(OUT, *parts)
    os.makedirs(p, exist_ok=True)
    return p


# ---- ImageFolder tree -------------------------------------------------------------------
folder = mkdir("folder")
Image.fromarray(picture(20, 30)).save(os.path.join(mkdir("folder", "cat"), "b.jpg"), quality=90)
Image.fromarray(picture(16, 16)).save(os.path.join(folder, "cat", "A.PNG"))
Image.fromarray(picture(9, 7, 1), "L").save(os.path.join(folder, "cat", "gray.png"))
open(os.path.join(folder, "cat", "notes.txt"), "w").write("not an image")
Image.fromarray(picture(12, 10)).save(os.path.join(mkdir("folder", "cat", "sub"), "c.jpeg"))
Image.fromarray(picture(11, 13)).save(os.path.join(mkdir("folder", "cat", "sub dir"), "d.jpg"))
Image.fromarray(picture(10, 14, 4), "RGBA").save(os.path.join(mkdir("folder", "dog"), "rgba.png"))
Image.fromarray(picture(8, 8)).save(os.path.join(folder, "dog", "z.jpg"))
Image.fromarray(picture(5, 6)).save(os.path.join(mkdir("folder", "Bird"), "x.png"))
open(os.path.join(folder, "README"), "w").write("a file beside the classes")
tv = ImageFolder(folder)

# ---- decode parity cases ----------------------------------------------------------------
decode = mkdir("decode")
cases = []


def case(name, modes=("RGB", "L", "RGBA"), expected=None, damaged=False):
    path = os.path.join(decode, name)
    for mode in modes:
        if expected is not None and mode in expected:
            arr, source = expected[mode], "numpy"
        else:
            arr, source = chw(Image.open(path).convert(mode)), "pillow"
        out = f"{path}.{mode}.expected"
        arr.tofile(out)
        cases.append({"file": path, "mode": mode, "shape": list(arr.shape),
                      "expected": out, "source": source, "damaged": damaged})


for name, size, kw in [
    ("q75_420.jpg", (48, 64), dict(quality=75, subsampling=2)),
    ("q95_444.jpg", (48, 64), dict(quality=95, subsampling=0)),
    ("q90_422.jpg", (33, 47), dict(quality=90, subsampling=1)),
    ("odd_420.jpg", (37, 23), dict(quality=85, subsampling=2)),
    ("tiny.jpg", (1, 1), dict(quality=90)),
    ("progressive.jpg", (61, 83), dict(quality=80, progressive=True)),
    ("progressive_444.jpg", (29, 31), dict(quality=92, progressive=True, subsampling=0)),
]:
    Image.fromarray(picture(*size)).save(os.path.join(decode, name), **kw)
    case(name)
Image.fromarray(picture(27, 41, 1), "L").save(os.path.join(decode, "gray.jpg"), quality=88)
case("gray.jpg")
Image.fromarray(picture(25, 34, 1), "L").save(os.path.join(decode, "gray_progressive.jpg"),
                                              quality=70, progressive=True)
case("gray_progressive.jpg")
# A photograph's size, with restart markers.
Image.fromarray(picture(375, 500)).save(os.path.join(decode, "photo_375x500.jpg"), quality=90,
                                        restart_marker_blocks=8)
case("photo_375x500.jpg", modes=("RGB", "L"))
Image.fromarray(picture(133, 97)).save(os.path.join(decode, "progressive_422.jpg"), quality=60,
                                       progressive=True, subsampling=1)
case("progressive_422.jpg", modes=("RGB",))
# CMYK (Pillow writes Adobe's inverted convention and reads every CMYK file so).
Image.fromarray(picture(21, 26, 4), "CMYK").save(os.path.join(decode, "cmyk.jpg"), quality=90)
case("cmyk.jpg")
Image.fromarray(picture(22, 19, 4), "CMYK").save(os.path.join(decode, "cmyk_progressive.jpg"),
                                                 quality=80, progressive=True)
case("cmyk_progressive.jpg", modes=("RGB",))
# Damaged entropy-coded data: libjpeg warns and decodes on; so do Pillow and Kiln.
whole = bytearray(open(os.path.join(decode, "q75_420.jpg"), "rb").read())
sos = whole.index(b"\xff\xda")
for at in range(sos + 40, sos + 60):
    if whole[at] not in (0x00, 0xFF) and whole[at - 1] != 0xFF:
        whole[at] ^= 0x5A
open(os.path.join(decode, "damaged_scan.jpg"), "wb").write(bytes(whole))
case("damaged_scan.jpg", modes=("RGB",), damaged=True)
# Scans cut short but an end-of-image marker after them: libjpeg warns, fills
# the rest, and Pillow returns the image; so does Kiln (a partial download has
# no end-of-image marker and is refused as truncated).
whole = open(os.path.join(decode, "progressive.jpg"), "rb").read()
open(os.path.join(decode, "cut_then_eoi.jpg"), "wb").write(whole[: len(whole) * 2 // 3] + b"\xff\xd9")
case("cut_then_eoi.jpg", modes=("RGB",))

Image.fromarray(picture(19, 23)).save(os.path.join(decode, "rgb.png"))
Image.fromarray(picture(19, 23, 4), "RGBA").save(os.path.join(decode, "rgba.png"))
Image.fromarray(picture(19, 23, 1), "L").save(os.path.join(decode, "l.png"))
Image.fromarray(picture(19, 23, 2), "LA").save(os.path.join(decode, "la.png"))
Image.fromarray(picture(19, 23)).quantize(16).save(os.path.join(decode, "p.png"))
pt = Image.fromarray(picture(19, 23)).quantize(16)
pt.save(os.path.join(decode, "p_trns.png"), transparency=3)
Image.fromarray(picture(19, 23, 1) > 128).convert("1").save(os.path.join(decode, "bits1.png"))
for name in ["rgb.png", "rgba.png", "l.png", "la.png", "p.png", "p_trns.png", "bits1.png"]:
    case(name, modes=("RGB", "L", "RGBA") if name != "p_trns.png" else ("RGB", "L"))

# 16-bit PNGs: Pillow keeps the high byte of 16-bit colour; for 16-bit gray it clips at
# 255 instead, so the expected 8-bit image there is numpy's high byte (torchvision's
# to_dtype(uint8, scale=True)).
g16 = (rng.integers(0, 65536, (13, 17))).astype(np.uint16)
Image.fromarray(g16).save(os.path.join(decode, "gray16.png"))
hi = (g16 >> 8).astype(np.uint8)[None]
case("gray16.png", modes=("RGB", "L"),
     expected={"RGB": np.concatenate([hi, hi, hi]), "L": hi})


def png16_rgb(path, arr):
    import struct
    import zlib
    h, w, _ = arr.shape
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(raw)))
        f.write(chunk(b"IEND", b""))


png16_rgb(os.path.join(decode, "rgb16.png"), rng.integers(0, 65536, (11, 9, 3)).astype(np.uint16))
case("rgb16.png", modes=("RGB",))

# ---- the other formats torchvision lists: WebP, BMP, TIFF, GIF ----------------------------
rgb = Image.fromarray(picture(35, 46))
rgba = Image.fromarray(picture(35, 46, 4), "RGBA")
gray = Image.fromarray(picture(35, 46, 1), "L")
rgb.save(os.path.join(decode, "lossy.webp"), quality=80)
rgba.save(os.path.join(decode, "lossy_alpha.webp"), quality=70)
rgb.save(os.path.join(decode, "lossless.webp"), lossless=True)
rgba.save(os.path.join(decode, "lossless_alpha.webp"), lossless=True)
Image.fromarray(picture(300, 257)).save(os.path.join(decode, "photo.webp"), quality=90)
rgb.save(os.path.join(decode, "animated.webp"), save_all=True, quality=85,
         append_images=[Image.fromarray(picture(35, 46)) for _ in range(2)], duration=100)
for name in ["lossy.webp", "lossy_alpha.webp", "lossless.webp", "lossless_alpha.webp",
             "photo.webp", "animated.webp"]:
    case(name)
rgb.save(os.path.join(decode, "rgb24.bmp"))
rgba.save(os.path.join(decode, "rgba32.bmp"))
gray.save(os.path.join(decode, "gray8.bmp"))
rgb.quantize(20).save(os.path.join(decode, "palette8.bmp"))
(gray.point(lambda v: 255 if v > 128 else 0)).convert("1").save(os.path.join(decode, "bits1.bmp"))
for name in ["rgb24.bmp", "rgba32.bmp", "gray8.bmp", "palette8.bmp", "bits1.bmp"]:
    case(name)
rgb.save(os.path.join(decode, "raw.tif"))
rgb.save(os.path.join(decode, "lzw.tif"), compression="tiff_lzw")
rgba.save(os.path.join(decode, "deflate_rgba.tif"), compression="tiff_adobe_deflate")
gray.save(os.path.join(decode, "packbits_gray.tif"), compression="packbits")
# Not decoded by Kiln: a palette TIFF (tests/data_image.rs checks the error).
rgb.quantize(30).save(os.path.join(decode, "palette.tif.unsupported"), format="TIFF")
Image.fromarray(picture(35, 46, 4), "CMYK").save(os.path.join(decode, "cmyk.tif"),
                                                 compression="tiff_lzw")
(gray.point(lambda v: 255 if v > 100 else 0)).convert("1").save(os.path.join(decode, "bits1.tif"))
for name in ["raw.tif", "lzw.tif", "deflate_rgba.tif", "packbits_gray.tif",
             "cmyk.tif", "bits1.tif"]:
    case(name)
g16 = rng.integers(0, 65536, (13, 17)).astype(np.uint16)
Image.fromarray(g16).save(os.path.join(decode, "gray16.tif"))
hi = (g16 >> 8).astype(np.uint8)[None]
case("gray16.tif", modes=("RGB", "L"), expected={"RGB": np.concatenate([hi, hi, hi]), "L": hi})
rgb.quantize(60).save(os.path.join(decode, "palette.gif"))
rgb.quantize(60).save(os.path.join(decode, "transparent.gif"), transparency=5)
gray.save(os.path.join(decode, "gray.gif"))
frames = [rgb.quantize(40)] + [Image.fromarray(picture(35, 46)).quantize(40) for _ in range(2)]
frames[0].save(os.path.join(decode, "animated.gif"), save_all=True, append_images=frames[1:],
               duration=80, loop=0)
for name in ["palette.gif", "transparent.gif", "gray.gif", "animated.gif"]:
    case(name)
rgb.save(os.path.join(decode, "colour.ppm"))
gray.save(os.path.join(decode, "gray.pgm"))
for name in ["colour.ppm", "gray.pgm"]:
    case(name)

# ---- equal-sized ImageFolder with a truncated JPEG --------------------------------------
stack = mkdir("stack")
for i in range(3):
    Image.fromarray(picture(6, 8)).save(os.path.join(mkdir("stack", "a"), f"{i}.jpg"), quality=90)
for i in range(2):
    Image.fromarray(picture(6, 8)).save(os.path.join(mkdir("stack", "b"), f"{i}.png"))
whole = open(os.path.join(stack, "a", "1.jpg"), "rb").read()
open(os.path.join(stack, "a", "1.jpg"), "wb").write(whole[: len(whole) // 2])
stack_samples = [[p, c] for p, c in ImageFolder(stack).samples]

# ---- empty class folder -----------------------------------------------------------------
empty = mkdir("empty")
Image.fromarray(picture(4, 4)).save(os.path.join(mkdir("empty", "full"), "x.png"))
open(os.path.join(mkdir("empty", "hollow"), "x.txt"), "w").write("no image")
try:
    ImageFolder(empty)
    empty_error = None
except FileNotFoundError as e:
    empty_error = str(e)

# ---- WebDataset shards ------------------------------------------------------------------
shards = mkdir("shards")


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    if tar.format == tarfile.PAX_FORMAT:
        info.pax_headers = {"path": name}  # a pax header for every member
    tar.addfile(info, io.BytesIO(data))


def encode(arr, fmt):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


shard_info = []
key = 0
for s, (count, fmt, label_kind) in enumerate([(5, "JPEG", "cls"), (3, "PNG", "cls"),
                                              (4, "JPEG", "cls"), (2, "PNG", "cls")]):
    path = os.path.join(shards, f"train-{s:06d}.tar")
    samples = []
    tar_format = tarfile.PAX_FORMAT if s == 3 else tarfile.GNU_FORMAT
    with tarfile.open(path, "w", format=tar_format) as tar:
        for _ in range(count):
            label = int(rng.integers(0, 10))
            k = f"{key:06d}"
            add(tar, f"{k}.{'jpg' if fmt == 'JPEG' else 'png'}", encode(picture(6, 8), fmt))
            add(tar, f"{k}.cls", str(label).encode())
            samples.append([k, label])
            key += 1
    shard_info.append({"path": path, "samples": samples})

# Labels in `json` members, under long (GNU `L` record) names.
json_path = os.path.join(shards, "json-000000.tar")
json_samples = []
with tarfile.open(json_path, "w", format=tarfile.GNU_FORMAT) as tar:
    for i in range(3):
        k = "d" * 120 + f"/sample{i}"
        label = 100 + i
        add(tar, f"{k}.png", encode(picture(6, 8), "PNG"))
        add(tar, f"{k}.json", json.dumps({"label": label, "caption": "é"}).encode())
        json_samples.append([k, label])

bad = mkdir("shards_bad")
truncated = os.path.join(bad, "truncated.tar")
whole = open(shard_info[0]["path"], "rb").read()
open(truncated, "wb").write(whole[: 512 + 100])  # inside the first member's data

print(json.dumps({
    "folder": {"root": folder, "class_to_idx": tv.class_to_idx,
               "samples": [[p, c] for p, c in tv.samples]},
    "stack": {"root": stack, "samples": stack_samples},
    "empty": {"root": empty, "error": empty_error},
    "decode": cases,
    "shards": shard_info,
    "json_shard": {"path": json_path, "samples": json_samples},
    "truncated": truncated,
}))
