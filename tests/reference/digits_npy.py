"""Saves scikit-learn's digits as NumPy arrays, for `dataset = "npy"`.

Usage: python digits_npy.py OUTDIR

Writes OUTDIR/x.npy (float64 [1797, 64], the pixels 0..16), OUTDIR/y.npy
(int64 [1797], the classes) and OUTDIR/y_column.npy (int64 [1797, 1], the
same labels as a column, which Kiln refuses).
"""

import os
import sys

import numpy as np
from sklearn.datasets import load_digits

out = sys.argv[1]
digits = load_digits()
np.save(os.path.join(out, "x.npy"), digits.data)
np.save(os.path.join(out, "y.npy"), digits.target.astype(np.int64))
np.save(os.path.join(out, "y_column.npy"), digits.target.astype(np.int64).reshape(-1, 1))
