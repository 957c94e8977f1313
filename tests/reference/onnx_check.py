"""Checks Kiln's ONNX exports against Kiln's own outputs with ONNX Runtime.

    python onnx_check.py DIR

DIR/manifest.json lists the cases: {"name", "model", "runs": [{"input", "expected"}]},
paths relative to DIR; each run's files are safetensors with one tensor, "x"
(the input) or "y" (Kiln's output for it). For each case the model is checked
with onnx.checker (full_check, which runs ONNX's shape inference too), run with
onnxruntime's CPUExecutionProvider on every input, and compared with Kiln's
output. Prints one JSON object: case name -> {"max_diff": [per run], "max_abs_expected", "ir_version",
"opset", "ops"} or {"error": message}; a case that fails does not stop the others.
"""

import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from safetensors.numpy import load_file


def check(directory, case):
    path = os.path.join(directory, case["model"])
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    diffs, scale = [], 0.0
    for run in case["runs"]:
        x = load_file(os.path.join(directory, run["input"]))["x"]
        expected = load_file(os.path.join(directory, run["expected"]))["y"]
        (got,) = session.run(None, {inp.name: x})
        if got.shape != expected.shape:
            raise ValueError(f"output shape {got.shape}, Kiln's {expected.shape}")
        if got.dtype != expected.dtype:
            raise ValueError(f"output dtype {got.dtype}, Kiln's {expected.dtype}")
        diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
        diffs.append(float(diff.max()) if diff.size else 0.0)
        scale = max(scale, float(np.abs(expected).max()) if expected.size else 0.0)
    return {
        "max_diff": diffs,
        "max_abs_expected": scale,
        "ir_version": model.ir_version,
        "opset": [[o.domain, o.version] for o in model.opset_import],
        "ops": sorted({n.op_type for n in model.graph.node}),
    }


def main():
    directory = sys.argv[1]
    with open(os.path.join(directory, "manifest.json")) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = check(directory, case)
        except Exception as e:  # reported per case, asserted on the Rust side
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
