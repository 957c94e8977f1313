"""Writes the names of TensorFlow's standard ops, one a line, to the path given:
every op type Python's TensorFlow registers (TF_GetAllOpList in a fresh process,
internal `_` ops included), which is what it can load in a graph.

The SavedModel exporter (tf-backend/src/saved_model/export/graph.rs) refuses a graph
holding an op outside this list: Python's TensorFlow, TF Serving and other
readers register exactly these ops, not Kiln's own (`KilnBiasGelu`, ...), so a
graph with another op type would not load there. Regenerate after a TensorFlow
upgrade:

    .kiln/venv/bin/python tf-backend/tests/reference/standard_ops.py \
        tf-backend/src/saved_model/export/standard_ops.txt
"""

import sys

import tensorflow as tf
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.client import pywrap_tf_session

ops = op_def_pb2.OpList()
ops.ParseFromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))
names = sorted({op.name for op in ops.op})
with open(sys.argv[1], "w", encoding="utf-8") as f:
    f.write(f"# the registered ops of TensorFlow {tf.__version__}; made by tf-backend/tests/reference/standard_ops.py\n")
    for name in names:
        f.write(name + "\n")
print(len(names))
