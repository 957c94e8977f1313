"""Runs the three files `kiln export` wrote for one checkpoint on the same
inputs, each in its own runtime (onnxruntime, torch.jit, tf.saved_model), and
prints what the CLI test compares as one JSON object.

usage: export_check.py DIR INPUT_NAME OUTPUT_NAME
DIR holds model.onnx, model.pt and savedmodel/ (the CNN of digits-cnn.toml, [N, 1, 8, 8] in).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import onnx
import onnxruntime as ort
import tensorflow as tf
import torch


def main():
    directory, input_name, output_name = sys.argv[1:4]
    x = np.random.default_rng(7).random((5, 1, 8, 8), dtype=np.float32)

    path = os.path.join(directory, "model.onnx")
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    from_onnx = session.run(None, {input_name: x})[0]

    script = torch.jit.load(os.path.join(directory, "model.pt"))
    script.eval()
    with torch.no_grad():
        from_script = script(torch.from_numpy(x)).numpy()

    loaded = tf.saved_model.load(os.path.join(directory, "savedmodel"))
    serving = loaded.signatures["serving_default"]
    from_tf = serving(**{input_name: tf.constant(x)})[output_name].numpy()

    print(json.dumps({
        "onnx_inputs": [i.name for i in session.get_inputs()],
        "onnx_outputs": [o.name for o in session.get_outputs()],
        "onnx_batch_dim": session.get_inputs()[0].shape[0],
        "ir_version": model.ir_version,
        "opset": [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")][0],
        "torchscript_keys": list(script.state_dict().keys()),
        "savedmodel_inputs": sorted(serving.structured_input_signature[1].keys()),
        "savedmodel_outputs": sorted(serving.structured_outputs.keys()),
        "onnx_vs_torchscript": float(np.abs(from_onnx - from_script).max()),
        "onnx_vs_savedmodel": float(np.abs(from_onnx - from_tf).max()),
        "shape": list(from_onnx.shape),
    }))


if __name__ == "__main__":
    main()
