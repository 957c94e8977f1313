"""A Keras 3 model exported as a SavedModel that Kiln can fine-tune, for Kiln's
`savedmodel_finetune` example.

Trains a small MLP on the digits 0-4 only (a stand-in for a pretrained model: it
has never seen a 5-9), then writes it with keras.export.ExportArchive, with two
endpoints (= signatures):

    serve(x: float32[?, 64]) -> output_0: float32[?, 10]   the logits, training=False
    train(x: float32[?, 64], y: int64[?]) -> {"loss": float32[]}
        sparse softmax cross-entropy on the logits, and one Adam step on the
        model's variables inside the function

and the optimizer's variables (`adam/iteration`, moments, `adam/learning_rate`)
as the collection `optimizer_variables`, so that Kiln checkpoints and resumes
them. Pixels are scaled to 0..1, as the example feeds them.

    python examples/savedmodel/export.py OUT_DIR [--data .kiln/data/digits.csv.gz]

Use the project virtualenv's Python (.kiln/venv/bin/python). OUT_DIR must not
exist. Prints the model's accuracy on all ten digits.
"""

import argparse
import gzip
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

SEED = 0


def load_digits(path):
    """Kiln's digits file: 64 pixel values (0-16) and the label, per line."""
    with gzip.open(path, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return rows[:, :64] / 16.0, rows[:, 64].astype(np.int64)


def main():
    root = pathlib.Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the SavedModel directory to create")
    parser.add_argument("--data", default=root / ".kiln/data/digits.csv.gz")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if os.path.exists(args.out):
        sys.exit(f"{args.out} exists; give a new directory")

    keras.utils.set_random_seed(SEED)
    model = keras.Sequential(
        [
            keras.Input(shape=(64,), dtype="float32"),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="digits_mlp",
    )
    optimizer = keras.optimizers.Adam(learning_rate=3e-3, name="adam")
    # Creates the optimizer's slots now, outside any tf.function trace.
    optimizer.build(model.trainable_variables)

    def train(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    # "Pretraining": the digits 0-4 only, with the same step the export carries.
    images, labels = load_digits(args.data)
    keep = labels < 5
    x, y = images[keep], labels[keep]
    step = tf.function(train)
    rng = np.random.default_rng(SEED)
    for epoch in range(args.epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), 64):
            batch = order[start : start + 64]
            loss = step(tf.constant(x[batch]), tf.constant(y[batch]))["loss"]
        print(f"epoch {epoch + 1}: loss {float(loss):.4f}")
    predicted = np.argmax(model(images, training=False).numpy(), axis=1)
    print(
        f"accuracy on the digits 0-4: {np.mean(predicted[keep] == labels[keep]):.3f}, "
        f"on all ten: {np.mean(predicted == labels):.3f}"
    )

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        name="serve",
        fn=lambda x: model(x, training=False),
        input_signature=[tf.TensorSpec([None, 64], tf.float32, name="x")],
    )
    archive.add_endpoint(
        name="train",
        fn=train,
        input_signature=[
            tf.TensorSpec([None, 64], tf.float32, name="x"),
            tf.TensorSpec([None], tf.int64, name="y"),
        ],
    )
    archive.add_variable_collection("optimizer_variables", list(optimizer.variables))
    archive.write_out(args.out, verbose=False)
    print(f"exported to {args.out}: serve(x: float32[?, 64]), train(x, y: int64[?])")


if __name__ == "__main__":
    main()
