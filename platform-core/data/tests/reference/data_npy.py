"""Writes .npy files with numpy, for kiln_data::read_npy.

Usage: python data_npy.py OUTDIR

Writes one file a case into OUTDIR (every dtype Kiln reads, both byte orders,
Fortran order, a scalar, an empty array, format versions 2.0 and 3.0) and
prints one JSON object mapping each file name to {"shape", "values"} as
numpy.load reads it back (values flattened in C order, as floats).
"""

import json
import os
import sys

import numpy as np

rng = np.random.default_rng(0)
out = sys.argv[1]
cases = {
    "f32.npy": rng.standard_normal((3, 4)).astype(np.float32),
    "f64.npy": rng.standard_normal((2, 3, 2)),
    "f16.npy": rng.standard_normal(5).astype(np.float16),
    "i64.npy": rng.integers(-10**12, 10**12, size=(4,)),
    "i32.npy": rng.integers(-2**31, 2**31, size=(2, 2), dtype=np.int32),
    "i16.npy": rng.integers(-2**15, 2**15, size=(3,), dtype=np.int16),
    "i8.npy": rng.integers(-128, 128, size=(3,), dtype=np.int8),
    "u8.npy": rng.integers(0, 256, size=(2, 1, 3), dtype=np.uint8),
    "u16.npy": rng.integers(0, 2**16, size=(3,), dtype=np.uint16),
    "u32.npy": rng.integers(0, 2**32, size=(3,), dtype=np.uint32),
    "bool.npy": rng.integers(0, 2, size=(2, 3)).astype(bool),
    "big_endian_f32.npy": rng.standard_normal((2, 3)).astype(">f4"),
    "big_endian_i64.npy": rng.integers(-10**6, 10**6, size=(3,)).astype(">i8"),
    "fortran_f32.npy": np.asfortranarray(rng.standard_normal((3, 2, 4)).astype(np.float32)),
    "scalar.npy": np.array(2.5),
    "empty.npy": np.zeros((0, 3), dtype=np.float32),
}
for name, array in cases.items():
    np.save(os.path.join(out, name), array)
for version in [(2, 0), (3, 0)]:
    name = f"v{version[0]}.npy"
    array = rng.standard_normal((2, 2)).astype(np.float32)
    with open(os.path.join(out, name), "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    cases[name] = array

print(json.dumps({
    name: {
        "shape": list(np.load(os.path.join(out, name)).shape),
        "values": [float(v) for v in np.load(os.path.join(out, name)).reshape(-1)],
    }
    for name in cases
}))
