"""Writes IDX files with numpy, for kiln_core::read_idx and load_mnist.

Usage: python data_idx.py OUTDIR

Writes into OUTDIR, in the layout of MNIST's files:
    train-images-idx3-ubyte      raw, uint8 [5, 4, 3]
    train-labels-idx1-ubyte.gz   gzip, uint8 [5]
    t10k-images-idx3-ubyte.gz    gzip, uint8 [2, 4, 3]
    t10k-labels-idx1-ubyte       raw, uint8 [2]
    floats-idx2-float            raw, big-endian float32 [2, 3] (type code 0x0D)
    shorts-idx1-int16.gz         gzip, big-endian int16 [4] (type code 0x0B)

Prints one JSON object mapping each file name to {"shape", "values"} (values flattened).
"""

import gzip
import json
import os
import struct
import sys

import numpy as np

TYPE_CODES = {np.dtype("uint8"): 0x08, np.dtype("int16"): 0x0B, np.dtype("float32"): 0x0D}


def idx_bytes(array):
    header = struct.pack(">BBBB", 0, 0, TYPE_CODES[array.dtype], array.ndim)
    header += struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(outdir, name, array, compress):
    data = idx_bytes(array)
    if compress:
        data = gzip.compress(data)
    with open(os.path.join(outdir, name), "wb") as f:
        f.write(data)
    return name, {"shape": list(array.shape), "values": array.flatten().tolist()}


def main():
    outdir = sys.argv[1]
    rng = np.random.default_rng(7)
    files = dict(
        [
            write(outdir, "train-images-idx3-ubyte",
                  rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8), False),
            write(outdir, "train-labels-idx1-ubyte.gz",
                  rng.integers(0, 10, size=5, dtype=np.uint8), True),
            write(outdir, "t10k-images-idx3-ubyte.gz",
                  rng.integers(0, 256, size=(2, 4, 3), dtype=np.uint8), True),
            write(outdir, "t10k-labels-idx1-ubyte",
                  rng.integers(0, 10, size=2, dtype=np.uint8), False),
            write(outdir, "floats-idx2-float",
                  rng.standard_normal((2, 3)).astype(np.float32), False),
            write(outdir, "shorts-idx1-int16.gz",
                  np.array([-32768, -1, 300, 32767], dtype=np.int16), True),
        ]
    )
    print(json.dumps(files))


if __name__ == "__main__":
    main()
