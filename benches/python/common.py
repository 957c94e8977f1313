"""Shared helpers for the Python baselines of Kiln's benchmark harness.

The Rust bench binary spawns ``bench_torch.py`` / ``bench_tf.py`` as
subprocesses and compares their training throughput with Kiln's. Every
script follows the same protocol, implemented here:

1. Command line: ``--workload mlp|cnn|transformer --data DIR --steps N
   --warmup W --repeats R --threads T [--device cpu|cuda[:N]]`` (plus
   ``--variant`` for TF).
2. Data: ``DIR/meta.json`` describes the batches; ``DIR/x.f32`` holds raw
   little-endian float32 inputs of shape ``[num_batches*batch] + input_shape``
   and ``DIR/y.i64`` raw little-endian int64 labels of shape
   ``[num_batches*batch]``. Steps are counted across the warm-up and all
   timed runs, and step k uses batch ``k % num_batches`` (as Kiln's workers
   do), so every variant trains on the same sequence of batches and the final
   losses compare. Scripts convert the batches to framework tensors once,
   before anything is timed.
3. Timing: W warm-up steps (untimed), then R repeats of N steps, each timed
   with ``time.perf_counter()``. A run only returns once its work is done
   (it reads the last loss back as a Python float).
4. Output: exactly one JSON line on stdout. Anything else a library prints,
   from Python or from native code, goes to stderr: ``reserve_stdout()``
   moves file descriptor 1 onto stderr and keeps the real stdout for the
   result line only.
"""

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np

# Per-sample input shape of each workload, as stored in the data files.
INPUT_SHAPES = {
    "mlp": [784],
    "cnn": [1, 28, 28],
    "transformer": [128, 256],
    "transformer-bf16": [256, 1024],
    "transformer-bf16-mixed": [256, 1024],
}


_RESULT_STREAM = None


def reserve_stdout():
    """Route fd 1 to stderr and return a stream on the original stdout.

    Call this before importing any framework, so that whatever native code
    writes to stdout cannot corrupt the single JSON result line. Later calls
    (a script importing another benchmark script) return the same stream.
    """
    global _RESULT_STREAM
    if _RESULT_STREAM is None:
        sys.stdout.flush()
        result_fd = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        _RESULT_STREAM = os.fdopen(result_fd, "w")
    return _RESULT_STREAM


def parse_args(description, variants=None, default_variant=None):
    """Parse the common command line; ``variants`` adds a --variant, required
    unless ``default_variant`` is given."""
    parser = argparse.ArgumentParser(description=description)
    if variants:
        parser.add_argument(
            "--variant",
            required=default_variant is None,
            default=default_variant,
            choices=variants,
        )
    parser.add_argument("--workload", required=True, choices=sorted(INPUT_SHAPES))
    parser.add_argument("--data", required=True, help="data directory (meta.json, x.f32, y.i64)")
    parser.add_argument("--steps", type=int, required=True, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=0, help="untimed warm-up steps")
    parser.add_argument("--repeats", type=int, default=1, help="number of timed repeats")
    parser.add_argument("--threads", type=int, required=True, help="intra/inter-op threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (PyTorch only)")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1 or args.threads < 1 or args.warmup < 0:
        parser.error("--steps, --repeats and --threads must be >= 1, --warmup >= 0")
    return args


def load_data(data_dir, workload):
    """Load the batches of ``data_dir`` as numpy arrays.

    Returns ``(meta, x, y)`` with ``x`` float32 of shape
    ``[num_batches, batch] + input_shape`` and ``y`` int64 of shape
    ``[num_batches, batch]``.
    """
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    if meta["workload"] != workload:
        raise SystemExit(f"{data_dir} holds workload {meta['workload']!r}, not {workload!r}")
    if list(meta["input_shape"]) != INPUT_SHAPES[workload]:
        raise SystemExit(
            f"{workload} expects input_shape {INPUT_SHAPES[workload]}, meta.json says {meta['input_shape']}"
        )
    num_batches, batch = meta["num_batches"], meta["batch"]
    x = np.fromfile(os.path.join(data_dir, "x.f32"), dtype="<f4")
    y = np.fromfile(os.path.join(data_dir, "y.i64"), dtype="<i8")
    x_shape = [num_batches, batch] + list(meta["input_shape"])
    if x.size != math.prod(x_shape) or y.size != num_batches * batch:
        raise SystemExit(f"data files in {data_dir} do not match meta.json {meta}")
    if y.min() < 0 or y.max() >= meta["classes"]:
        raise SystemExit(f"labels in {data_dir} fall outside [0, {meta['classes']})")
    return meta, x.reshape(x_shape), y.reshape(num_batches, batch)


class StepCounter:
    """The index of the next training step, across warm-up and timed runs."""

    def __init__(self):
        self.next = 0

    def take(self, n):
        """The step indices of a run of n steps."""
        first = self.next
        self.next += n
        return range(first, first + n)


def run_protocol(run_steps, steps, warmup, repeats):
    """Warm up, then time ``repeats`` runs of ``steps`` steps.

    ``run_steps(n)`` must run n training steps, wait until they are finished
    and return the loss it reports as a Python float. Returns the list of
    per-repeat seconds and the loss of the last timed run.
    """
    if warmup > 0:
        run_steps(warmup)
    seconds = []
    loss = float("nan")
    for _ in range(repeats):
        start = time.perf_counter()
        loss = run_steps(steps)
        seconds.append(time.perf_counter() - start)
    return seconds, loss


def peak_rss_mb():
    """Peak resident set size of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit_result(stream, *, variant, args, batch, seconds, final_loss, versions, extra=None):
    """Write the single JSON result line; exit with an error on a non-finite loss."""
    if not math.isfinite(final_loss):
        raise SystemExit(f"{variant}/{args.workload}: non-finite final loss {final_loss}")
    median = statistics.median(seconds)
    result = {
        "device": getattr(args, "device", "cpu"),
        "variant": variant,
        "workload": args.workload,
        "batch": batch,
        "steps": args.steps,
        "repeats_s": seconds,
        "median_s": median,
        "steps_per_s": args.steps / median,
        "samples_per_s": args.steps * batch / median,
        "peak_rss_mb": peak_rss_mb(),
        "final_loss": final_loss,
        "threads": args.threads,
        "versions": {"python": platform.python_version(), **versions},
        **(extra or {}),
    }
    stream.write(json.dumps(result) + "\n")
    stream.flush()
