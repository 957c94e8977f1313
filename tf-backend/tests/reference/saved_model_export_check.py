"""Runs SavedModels that Kiln exported, with Python's TensorFlow, and prints how
far each is from Kiln's own outputs (used by tests/saved_model_export.rs).

    python saved_model_export_check.py manifest.json

The manifest is a list of {name, dir, data, input_name, output_name, state?}:
`data` is a safetensors file with `input` and `expected` (Kiln's TfModel forward
in eval mode, at a batch size other than the export's). Each SavedModel is
loaded with `tf.saved_model.load` and its `serving_default` signature is called
by keyword. When `state` (a safetensors state dict) is given, the SavedModel's
checkpoint `variables/variables` must hold exactly those tensors.

Prints one JSON object: name -> {"output": max |python - kiln|, "state": max
|checkpoint - state dict| or null, "batch_dim": the signature's batch dim,
"variables"/"trainable": how many tf.Variables the loader made of them}.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf
from safetensors.numpy import load_file


def check(entry):
    loaded = tf.saved_model.load(entry["dir"])
    signature = loaded.signatures["serving_default"]
    _, kwargs = signature.structured_input_signature
    spec = kwargs[entry["input_name"]]
    data = load_file(entry["data"])
    x = data["input"]
    outputs = signature(**{entry["input_name"]: tf.constant(x)})
    got = outputs[entry["output_name"]].numpy()
    expected = data["expected"]
    if got.shape != expected.shape:
        raise SystemExit(f"{entry['name']}: output shape {got.shape}, Kiln's {expected.shape}")
    result = {
        "output": float(np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))))
        if got.size
        else 0.0,
        "state": None,
        "batch_dim": spec.shape[0],
        "variables": len(loaded.variables),
        "trainable": sum(1 for v in loaded.variables if v.trainable),
    }
    if entry.get("state"):
        state = load_file(entry["state"])
        reader = tf.train.load_checkpoint(os.path.join(entry["dir"], "variables", "variables"))
        stored = set(reader.get_variable_to_shape_map())
        if stored != set(state):
            raise SystemExit(f"{entry['name']}: checkpoint holds {sorted(stored)}, state dict {sorted(state)}")
        result["state"] = max(
            float(np.max(np.abs(reader.get_tensor(k).astype(np.float64) - v.astype(np.float64))))
            for k, v in state.items()
        )
    return result


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        manifest = json.load(f)
    print(json.dumps({entry["name"]: check(entry) for entry in manifest}))


if __name__ == "__main__":
    main()
