"""TensorFlow/Keras baselines ("tf-function", "keras-fit") for Kiln's benchmark harness.

Usage:
    python bench_tf.py --variant tf-function|keras-fit
        --workload mlp|cnn|transformer --data DIR
        --steps N --warmup W --repeats R --threads T

Both variants train the same Keras model on CPU (channels-last for the CNN:
the NCHW data is transposed to NHWC once, before timing) with
``keras.optimizers.Adam(learning_rate=1e-3, epsilon=1e-8)`` and
``SparseCategoricalCrossentropy(from_logits=True)``, following the protocol
described in ``common.py``:

- tf-function: a ``@tf.function`` step (``tf.GradientTape`` +
  ``optimizer.apply_gradients``) called on ``tf.constant`` batches built before
  timing; each run ends by reading the last loss with ``float(loss)``.
- keras-fit: ``model.compile`` (no metrics, ``jit_compile=False``) and one
  ``model.fit(..., batch_size=batch, epochs=1, shuffle=False, verbose=0)`` per
  run, on numpy arrays tiled from the batches so that the run covers exactly
  its number of steps. fit's own per-call overhead is part of the measurement.
  Its reported loss is Keras's running mean of the loss over that fit call
  (what ``History`` records), not the loss of the last step.

Prints one JSON line on stdout.
"""

import os

import common

RESULT_STREAM = common.reserve_stdout()
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"

import numpy as np  # noqa: E402  (imported after stdout is reserved)
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from keras import layers  # noqa: E402

VARIANTS = ("tf-function", "keras-fit")


def build_model(workload, classes):
    """The workload's Keras model (channels-last for the CNN); call after seeding."""
    if workload == "mlp":
        return keras.Sequential([
            keras.Input((784,)),
            layers.Dense(256, activation="relu"),
            layers.Dense(classes),
        ])
    if workload == "cnn":
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
            layers.Dense(classes),
        ])
    # Pre-norm transformer encoder block followed by a linear classifier.
    x = keras.Input((128, 256))
    a = layers.LayerNormalization(epsilon=1e-5)(x)
    h = layers.Add()([x, layers.MultiHeadAttention(num_heads=8, key_dim=32)(a, a)])
    f = layers.LayerNormalization(epsilon=1e-5)(h)
    f = layers.Dense(1024, activation="gelu")(f)  # keras gelu is exact by default
    h = layers.Add()([h, layers.Dense(256)(f)])
    logits = layers.Dense(classes)(layers.Flatten()(h))
    return keras.Model(x, logits)


def tf_function_runner(model, x_np, y_np):
    """run_steps for the tf-function variant."""
    xs = [tf.constant(b) for b in x_np]
    ys = [tf.constant(b) for b in y_np]
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-8)
    opt.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    counter = common.StepCounter()

    def run_steps(n):
        for i in counter.take(n):
            j = i % len(xs)
            loss = train_step(xs[j], ys[j])
        return float(loss)

    return run_steps


def keras_fit_runner(model, x_np, y_np, max_steps):
    """run_steps for the keras-fit variant; runs may be up to max_steps long."""
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-8),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    # Tile the batches once, in step order (step k uses batch k % num_batches);
    # a run of n steps starting at step k fits in the slice starting at batch
    # k % num_batches (a view, no copy), so the tiles cover max_steps plus one cycle.
    num_batches, batch = y_np.shape
    tiled = max_steps + num_batches
    order = np.arange(tiled) % num_batches
    x_all = x_np[order].reshape((tiled * batch,) + x_np.shape[2:])
    y_all = y_np[order].reshape(tiled * batch)
    counter = common.StepCounter()

    def run_steps(n):
        first = counter.take(n).start % num_batches
        rows = slice(first * batch, (first + n) * batch)
        history = model.fit(
            x_all[rows], y_all[rows],
            batch_size=batch, epochs=1, shuffle=False, verbose=0,
        )
        return float(history.history["loss"][-1])

    return run_steps


def main():
    args = common.parse_args(__doc__.splitlines()[0], variants=VARIANTS)
    if args.device != "cpu":
        raise SystemExit(f"--device {args.device}: the pinned tensorflow-cpu wheel runs on the CPU only")
    # Must happen before any TF op runs.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    meta, x_np, y_np = common.load_data(args.data, args.workload)
    if args.workload == "cnn":
        x_np = np.ascontiguousarray(x_np.transpose(0, 1, 3, 4, 2))  # NCHW -> NHWC

    keras.utils.set_random_seed(0)
    model = build_model(args.workload, meta["classes"])
    if args.variant == "tf-function":
        run_steps = tf_function_runner(model, x_np, y_np)
    else:
        run_steps = keras_fit_runner(model, x_np, y_np, max(args.steps, args.warmup))

    seconds, final_loss = common.run_protocol(run_steps, args.steps, args.warmup, args.repeats)
    common.emit_result(
        RESULT_STREAM,
        variant=args.variant,
        args=args,
        batch=meta["batch"],
        seconds=seconds,
        final_loss=final_loss,
        versions={"tensorflow": tf.__version__, "keras": keras.__version__},
    )


if __name__ == "__main__":
    main()
