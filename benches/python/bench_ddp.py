"""PyTorch DistributedDataParallel and torch.distributed baselines of section (h) of
Kiln's benchmark harness, run as two ranks under torchrun.

Usage:
    torchrun --standalone --nproc-per-node=2 bench_ddp.py --task train
        --workload mlp|cnn|transformer --dir DIR --steps N --warmup W --repeats R
    torchrun --standalone --nproc-per-node=2 bench_ddp.py --task collectives
        [--workload collectives --dir DIR --steps 0 --warmup W --repeats R]

Each rank mirrors a Kiln rank of ``benches/compare/ddp.rs``: one intra-op thread
(``torch.set_num_threads(1)``), ``init_process_group("gloo")`` from torchrun's
variables, and rank 0 prints one JSON line on stdout (see ``common.py``).

- train: the workload's model (``bench_torch.build_model``, seeded 0) wrapped in
  ``DistributedDataParallel`` with its defaults, ``torch.optim.Adam(lr=1e-3)``, the
  loop of ``bench_torch.py`` (``zero_grad(set_to_none=True)``, ``F.cross_entropy``,
  ``backward``, ``step``; ``loss.item()`` at the end of a run). At step k rank r
  trains on batch ``k * world + r`` (mod the batch count) of DIR. Per repeat, each
  after a barrier: N DDP steps; N steps of a copy of the model without DDP (the
  compute alone); N all-reduces (sum) of one float32 tensor with as many values as
  the model has parameters (the communication alone). Medians per step, of
  wall-clock time and, for the two kinds of step, of the process's CPU time.
- collectives: ``dist.all_reduce`` (sum) of one float, each of 1000 calls timed
  after 100 untimed; then, 20 calls after 3 each, the all-reduce of 100 MB of
  float32, ``reduce_scatter_tensor`` of 100 MB and ``all_gather_into_tensor`` of
  50 MB per rank into 100 MB.
"""

import argparse
import gc
import json
import statistics
import time

import common

RESULT_STREAM = common.reserve_stdout()

import torch  # noqa: E402  (imported after stdout is reserved)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import bench_torch  # noqa: E402  (the workloads' model definitions)

LATENCY_WARMUP, LATENCY_CALLS = 100, 1000
BANDWIDTH_BYTES, BANDWIDTH_WARMUP, BANDWIDTH_CALLS = 100_000_000, 3, 20


def cpu_seconds():
    """CPU seconds this process has used so far, all its threads (``utime + stime``
    of ``/proc/self/stat`` in ticks of 1/100 s, what the Kiln ranks read)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # State is field 3, utime 14, stime 15.
        return (int(fields[14 - 3]) + int(fields[15 - 3])) / 100.0
    except (OSError, IndexError, ValueError):
        return float("nan")


def aligned(f):
    """``f()``, started on every rank at once (after a barrier): (wall-clock
    seconds, CPU seconds, its value)."""
    dist.barrier()
    start, cpu = time.perf_counter(), cpu_seconds()
    value = f()
    return time.perf_counter() - start, cpu_seconds() - cpu, value


def train(args, rank, world):
    meta, x_np, y_np = common.load_data(args.dir, args.workload)
    if len(x_np) % world:
        raise SystemExit(f"{len(x_np)} batches do not split over {world} ranks")
    mine = range(rank, len(x_np), world)
    xs = [torch.from_numpy(x_np[j].copy()) for j in mine]
    ys = [torch.from_numpy(y_np[j].copy()) for j in mine]

    torch.manual_seed(0)
    model = DistributedDataParallel(bench_torch.build_model(args.workload, meta["classes"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    torch.manual_seed(0)
    local = bench_torch.build_model(args.workload, meta["classes"])
    local_opt = torch.optim.Adam(local.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    model.train()
    local.train()
    values = sum(p.numel() for p in local.parameters())
    gradients = torch.zeros(values)

    def stepper(net, optimizer):
        counter = common.StepCounter()

        def run_steps(n):
            loss = None
            for i in counter.take(n):
                j = i % len(xs)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(xs[j]), ys[j])
                loss.backward()
                optimizer.step()
            return float("nan") if loss is None else loss.item()

        return run_steps

    ddp_steps, local_steps = stepper(model, opt), stepper(local, local_opt)

    def reduce(n):
        for _ in range(n):
            dist.all_reduce(gradients)

    ddp_steps(args.warmup)
    local_steps(args.warmup)
    reduce(args.warmup)
    ddp_s, local_s, reduce_s, ddp_cpu, local_cpu = [], [], [], [], []
    last = float("nan")
    for _ in range(args.repeats):
        seconds, cpu, last = aligned(lambda: ddp_steps(args.steps))
        ddp_s.append(seconds)
        ddp_cpu.append(cpu)
        seconds, cpu, _ = aligned(lambda: local_steps(args.steps))
        local_s.append(seconds)
        local_cpu.append(cpu)
        reduce_s.append(aligned(lambda: reduce(args.steps))[0])
    # The mean of the last loss over the ranks, what Kiln's step returns.
    loss = torch.tensor([last], dtype=torch.float64)
    dist.all_reduce(loss)
    m = statistics.median(ddp_s)
    per_step_ms = lambda s: statistics.median(s) / args.steps * 1e3  # noqa: E731
    batch = meta["batch"]
    return {
        "workload": args.workload,
        "batch": batch,
        "steps": args.steps,
        "repeats_s": ddp_s,
        "median_s": m,
        "steps_per_s": args.steps / m,
        "samples_per_s": args.steps * batch * world / m,
        "ddp_step_ms": m / args.steps * 1e3,
        "local_step_ms": per_step_ms(local_s),
        "allreduce_ms": per_step_ms(reduce_s),
        "ddp_cpu_ms": per_step_ms(ddp_cpu),
        "local_cpu_ms": per_step_ms(local_cpu),
        "gradient_bytes": values * 4,
        "final_loss": loss.item() / world,
    }


def collectives():
    def each_call(call, warmup, calls):
        for _ in range(warmup):
            call()
        dist.barrier()
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        return seconds

    # Zeros: a sum repeated a thousand times stays finite.
    one = torch.zeros(1)
    latency = each_call(lambda: dist.all_reduce(one), LATENCY_WARMUP, LATENCY_CALLS)
    whole = torch.zeros(BANDWIDTH_BYTES // 4)
    bandwidth = each_call(lambda: dist.all_reduce(whole), BANDWIDTH_WARMUP, BANDWIDTH_CALLS)
    share = torch.zeros(BANDWIDTH_BYTES // 4 // dist.get_world_size())
    reduce_scatter = each_call(
        lambda: dist.reduce_scatter_tensor(share, whole), BANDWIDTH_WARMUP, BANDWIDTH_CALLS
    )
    all_gather = each_call(
        lambda: dist.all_gather_into_tensor(whole, share), BANDWIDTH_WARMUP, BANDWIDTH_CALLS
    )

    def quantile(v, q):
        v = sorted(v)
        return v[round((len(v) - 1) * q)]

    big, rs, ag = (statistics.median(v) for v in (bandwidth, reduce_scatter, all_gather))
    return {
        "latency_us": statistics.median(latency) * 1e6,
        "latency_p10_us": quantile(latency, 0.1) * 1e6,
        "latency_p90_us": quantile(latency, 0.9) * 1e6,
        "bandwidth_ms": big * 1e3,
        "bandwidth_gb_s": BANDWIDTH_BYTES / big / 1e9,
        "bandwidth_calls_s": bandwidth,
        "reduce_scatter_ms": rs * 1e3,
        "reduce_scatter_gb_s": BANDWIDTH_BYTES / rs / 1e9,
        "reduce_scatter_calls_s": reduce_scatter,
        "all_gather_ms": ag * 1e3,
        "all_gather_gb_s": BANDWIDTH_BYTES / ag / 1e9,
        "all_gather_calls_s": all_gather,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=["train", "collectives"])
    parser.add_argument("--workload", default="collectives",
                        choices=["mlp", "cnn", "transformer", "collectives"])
    parser.add_argument("--dir", default=".", help="the workload's data (meta.json, x.f32, y.i64)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per repeat")
    parser.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats")
    args = parser.parse_args()
    if args.task == "train" and (args.workload == "collectives" or args.steps < 1):
        parser.error("--task train needs --workload mlp|cnn|transformer and --steps >= 1")

    bench_torch.set_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = train(args, rank, world) if args.task == "train" else collectives()
    # DDP's module and reducer sit in reference cycles: left to the interpreter's
    # finalization, their Gloo threads are sometimes torn down unjoined and the
    # process aborts ("terminate called without an active exception") after its
    # work is done. Collected here, before the group is destroyed, they are not.
    gc.collect()
    dist.barrier()
    if rank == 0:
        result.update(
            variant="pytorch-ddp-" + args.workload if args.task == "train" else "pytorch-gloo",
            world_size=world,
            threads=1,
            peak_rss_mb=common.peak_rss_mb(),
            versions={"torch": torch.__version__},
        )
        RESULT_STREAM.write(json.dumps(result) + "\n")
        RESULT_STREAM.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
