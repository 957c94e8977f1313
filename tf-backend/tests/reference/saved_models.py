"""SavedModel fixtures and references for kiln-tf's SavedModel tests.

Usage:
    python saved_models.py export OUT_DIR
    python saved_models.py serve MODEL_DIR INPUT.json OUT.json
    python saved_models.py train MODEL_DIR BATCHES.json OUT.json
    python saved_models.py features OUT_DIR

`export` writes into OUT_DIR:

    mlp/            a Keras 3 MLP (8 -> 16 -> 3, seeded weights) exported with
                    keras.export.ExportArchive; endpoints (= signatures):
                      serve(x: float32[?, 8]) -> output_0: float32[?, 3] (the logits)
                      train(x: float32[?, 8], y: int32[?]) -> loss: float32[]
                        (sparse softmax cross-entropy on the logits; one Adam step
                        on the model's variables inside the function)
                      serving_default: the alias of `serve` that ExportArchive adds
                    The optimizer's variables are used by `train`, so they are saved
                    too; they are also exposed as `optimizer_variables`.
    mlp_bn/         the same recipe (serve, train, serving_default endpoints and
                    `optimizer_variables`) on a Keras 3 model with batch norm:
                    Dense(16) -> BatchNormalization -> ReLU -> Dense(3), seeded;
                    `train` calls the model with training=True, so it updates the
                    batch-norm moving mean and variance (non-trainable variables)
                    as well as the Adam step; `serve` uses them (training=False).
    counter/        a plain tf.Module (no Keras) with one variable w = [1, 2, 3]:
                      serving_default(x: float32[?, 3]) -> y = x * w
                      bump() -> w: w += 1, returns the new w
    nosaver/        a variable-free SavedModel whose MetaGraphDef has no SaverDef
                    (serve(x) = 2 x), for the "no saver" error.
    reference.json  {"serve_input": T, "serve_output": T,
                     "train_x": [T] * 5, "train_y": [T] * 5,
                     "losses": [float] * 5, "trained_output": T, "steps": 5}
                    where T is {"shape": [...], "dtype": "...", "data": [flat values]}.
                    The losses and trained_output come from an identical copy of the
                    model (same seed, checked equal) trained eagerly in Python with
                    its own Adam: the exported graph is not used for the reference.

`features` writes into OUT_DIR (for the `saved_model` layer tests):

    features/       the `mlp` model (same seed and weights) exported with
                    keras.export.ExportArchive; endpoints:
                      features(x: float32[?, 8]) -> output_0: float32[?, 16] (the
                        hidden layer's ReLU activations)
                      serve(x: float32[?, 8]) -> output_0: float32[?, 3] (the logits)
                      unsized(x: float32[?, 8]) -> output_0: float32[?, ?] (the
                        features again, through a reshape of unknown static shape)
    features_reseeded/  the same export from another seed: other weights under the
                    same variable names.

`serve` loads MODEL_DIR with tf.saved_model.load and writes to OUT.json
{"serve": T, "serving_default": T, "iterations": int or null}: the (only) output of
the `serve` method and of the `serving_default` signature on INPUT.json's tensor,
and the optimizer's iteration count as restored from the checkpoint (null without
`optimizer_variables`).

`train` loads MODEL_DIR with tf.saved_model.load, calls its `train` signature on the
batches of BATCHES.json ({"x": T, "y": T, "batch": int, "epochs": int,
"serve_input": T}: the rows in order, `batch` at a time, the last batch possibly
smaller, `epochs` times over) and writes to OUT.json {"losses": [float],
"trained_output": T, "variables": {name: T}}: each call's loss, the
`serving_default` output on `serve_input` afterwards, and the model's variables
(the archive's `variables`, by Keras name) afterwards.
"""

import json
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

SEED = 1234
STEPS = 5
BATCH = 16
LEARNING_RATE = 0.05


def tensor_json(array):
    array = np.asarray(array)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "data": [v.item() for v in array.reshape(-1)],
    }


def tensor_from_json(value):
    return np.asarray(value["data"], dtype=value["dtype"]).reshape(value["shape"])


def build_model():
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input(shape=(8,), dtype="float32"),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="mlp",
    )
    optimizer = keras.optimizers.Adam(learning_rate=LEARNING_RATE)
    # Creates the optimizer's slots now, outside any tf.function trace.
    optimizer.build(model.trainable_variables)
    return model, optimizer


def build_bn_model():
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input(shape=(8,), dtype="float32"),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(name="relu"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="mlp_bn",
    )
    # Named explicitly: a second Adam in the process would be `adam_1`.
    optimizer = keras.optimizers.Adam(learning_rate=LEARNING_RATE, name="adam")
    optimizer.build(model.trainable_variables)
    return model, optimizer


def loss_fn(y, logits):
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    )


def make_train_step(model, optimizer):
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    return train


def export_mlp(path, build=build_model):
    model, optimizer = build()
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        name="serve",
        fn=lambda x: model(x, training=False),
        input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")],
    )
    archive.add_endpoint(
        name="train",
        fn=make_train_step(model, optimizer),
        input_signature=[
            tf.TensorSpec([None, 8], tf.float32, name="x"),
            tf.TensorSpec([None], tf.int32, name="y"),
        ],
    )
    archive.add_variable_collection("optimizer_variables", list(optimizer.variables))
    archive.write_out(path, verbose=False)
    return model


class Counter(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable([1.0, 2.0, 3.0], name="w")

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def serve(self, x):
        return {"y": x * self.w}

    @tf.function(input_signature=[])
    def bump(self):
        self.w.assign_add(tf.ones([3]))
        return {"w": tf.identity(self.w)}


def export_counter(path):
    counter = Counter()
    tf.saved_model.save(
        counter, path, signatures={"serving_default": counter.serve, "bump": counter.bump}
    )


def export_nosaver(path):
    module = tf.Module()
    module.serve = tf.function(
        lambda x: {"y": 2.0 * x},
        input_signature=[tf.TensorSpec([None], tf.float32, name="x")],
    )
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve})
    from tensorflow.core.protobuf import saved_model_pb2

    pb = os.path.join(path, "saved_model.pb")
    proto = saved_model_pb2.SavedModel()
    with open(pb, "rb") as f:
        proto.ParseFromString(f.read())
    for meta_graph in proto.meta_graphs:
        meta_graph.ClearField("saver_def")
    with open(pb, "wb") as f:
        f.write(proto.SerializeToString())
    # Without a saver nothing restores the (object-graph only) checkpoint either.
    shutil.rmtree(os.path.join(path, "variables"))
    os.makedirs(os.path.join(path, "variables"))


def export(out_dir):
    exported = export_mlp(os.path.join(out_dir, "mlp"))
    export_mlp(os.path.join(out_dir, "mlp_bn"), build=build_bn_model)
    export_counter(os.path.join(out_dir, "counter"))
    export_nosaver(os.path.join(out_dir, "nosaver"))

    rng = np.random.default_rng(SEED)
    serve_input = rng.standard_normal((4, 8)).astype(np.float32)
    train_x = [rng.standard_normal((BATCH, 8)).astype(np.float32) for _ in range(STEPS)]
    train_y = [rng.integers(0, 3, size=(BATCH,)).astype(np.int32) for _ in range(STEPS)]

    # An identical copy, trained eagerly with its own optimizer.
    model, optimizer = build_model()
    for a, b in zip(exported.get_weights(), model.get_weights()):
        assert np.array_equal(a, b), "the reference copy differs from the exported model"
    serve_output = model(serve_input, training=False).numpy()
    step = make_train_step(model, optimizer)
    losses = [float(step(x, y)["loss"].numpy()) for x, y in zip(train_x, train_y)]
    trained_output = model(serve_input, training=False).numpy()

    reference = {
        "serve_input": tensor_json(serve_input),
        "serve_output": tensor_json(serve_output),
        "train_x": [tensor_json(x) for x in train_x],
        "train_y": [tensor_json(y) for y in train_y],
        "losses": losses,
        "trained_output": tensor_json(trained_output),
        "steps": STEPS,
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)


def export_features(path, seed=SEED):
    model, _ = build_model()
    if seed != SEED:
        rng = np.random.default_rng(seed)
        for v in model.weights:
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
    hidden = model.get_layer("hidden")
    archive = keras.export.ExportArchive()
    archive.track(model)
    spec = [tf.TensorSpec([None, 8], tf.float32, name="x")]
    archive.add_endpoint(name="features", fn=lambda x: hidden(x), input_signature=spec)
    archive.add_endpoint(
        name="serve", fn=lambda x: model(x, training=False), input_signature=spec
    )
    # The same features through a reshape TensorFlow cannot size statically.
    archive.add_endpoint(
        name="unsized",
        fn=lambda x: tf.reshape(hidden(x), tf.stack([tf.shape(x)[0], -1])),
        input_signature=spec,
    )
    archive.write_out(path, verbose=False)


def serve(model_dir, input_path, out_path):
    loaded = tf.saved_model.load(model_dir)
    with open(input_path) as f:
        x = tf.constant(tensor_from_json(json.load(f)))
    by_endpoint = loaded.serve(x)
    if isinstance(by_endpoint, dict):
        (by_endpoint,) = by_endpoint.values()
    (by_signature,) = loaded.signatures["serving_default"](x=x).values()
    iterations = None
    for v in getattr(loaded, "optimizer_variables", []):
        if v.name.split(":")[0].endswith("iteration"):
            iterations = int(v.numpy())
    result = {
        "serve": tensor_json(by_endpoint.numpy()),
        "serving_default": tensor_json(by_signature.numpy()),
        "iterations": iterations,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def train(model_dir, batches_path, out_path):
    loaded = tf.saved_model.load(model_dir)
    with open(batches_path) as f:
        spec = json.load(f)
    x, y = tensor_from_json(spec["x"]), tensor_from_json(spec["y"])
    batch, epochs = spec["batch"], spec["epochs"]
    step = loaded.signatures["train"]
    losses = []
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            out = step(
                x=tf.constant(x[start : start + batch]),
                y=tf.constant(y[start : start + batch]),
            )
            losses.append(float(out["loss"].numpy()))
    serve_input = tf.constant(tensor_from_json(spec["serve_input"]))
    (output,) = loaded.signatures["serving_default"](x=serve_input).values()
    with open(out_path, "w") as f:
        json.dump(
            {
                "losses": losses,
                "trained_output": tensor_json(output.numpy()),
                "variables": {
                    v.name.split(":")[0]: tensor_json(v.numpy())
                    for v in getattr(loaded, "variables", [])
                },
            },
            f,
        )


def main():
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "export" and len(sys.argv) == 3:
        export(sys.argv[2])
    elif command == "serve" and len(sys.argv) == 5:
        serve(sys.argv[2], sys.argv[3], sys.argv[4])
    elif command == "features" and len(sys.argv) == 3:
        export_features(os.path.join(sys.argv[2], "features"))
        export_features(os.path.join(sys.argv[2], "features_reseeded"), seed=SEED + 1)
    elif command == "train" and len(sys.argv) == 5:
        train(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
