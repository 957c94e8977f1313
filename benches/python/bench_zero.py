"""PyTorch baselines of section (m) of Kiln's benchmark harness (sharded
strategies), run as two ranks under torchrun.

Usage:
    torchrun --standalone --nproc-per-node=2 bench_zero.py
        --variant pytorch-ddp|pytorch-zero1|pytorch-fsdp|pytorch-ddp-ckpt|...
        --steps N --warmup W --repeats R

Each rank mirrors a Kiln rank of ``benches/compare/zero.rs``: one intra-op thread,
``init_process_group("gloo")``, 14 pre-norm encoder blocks of width 768 (12 heads,
feed-forward 3072; ``bench_torch.EncoderClassifier``'s block), the sequence of 64
flattened into a 10-class linear head, batch 4 per rank, Adam (lr 1e-4). ``ddp``:
``DistributedDataParallel`` and ``torch.optim.Adam``; ``zero1``: the same model
with ``ZeroRedundancyOptimizer(optimizer_class=torch.optim.Adam)``; ``fsdp``:
``fully_shard`` (FSDP2) on every block, then on the root, and ``torch.optim.Adam``
over the sharded parameters; ``-ckpt``: each
block under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Rank 0
prints one JSON line: steps per second (median over the repeats), its peak
resident set, and the state it holds after a step (parameters, gradients still
held, optimizer state; this rank's shards under FSDP), in MiB.
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
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import bench_torch  # noqa: E402

BLOCKS, WIDTH, HEADS, FF, SEQ, BATCH, CLASSES, BATCHES = 14, 768, 12, 3072, 64, 4, 10, 4


class Block(nn.Module):
    """One pre-norm encoder block, as ``bench_torch.EncoderClassifier`` has."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH, eps=1e-5)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH, eps=1e-5)
        self.ff = nn.Sequential(nn.Linear(WIDTH, FF), nn.GELU(), nn.Linear(FF, WIDTH))

    def forward(self, x):
        a = self.ln1(x)
        h = x + self.attn(a, a, a, need_weights=False)[0]
        return h + self.ff(self.ln2(h))


class Model(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(SEQ * WIDTH, CLASSES)
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x.flatten(1))


def tensor_bytes(tensors):
    """Bytes held here: a sharded tensor's local shard only."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True,
                        choices=["pytorch-ddp", "pytorch-zero1", "pytorch-fsdp",
                                 "pytorch-ddp-ckpt", "pytorch-zero1-ckpt",
                                 "pytorch-fsdp-ckpt"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    zero = "zero1" in args.variant
    fsdp = "fsdp" in args.variant
    checkpointed = args.variant.endswith("-ckpt")

    bench_torch.set_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    batches = [(torch.randn(BATCH, SEQ, WIDTH), torch.randint(CLASSES, (BATCH,)))
               for _ in range(BATCHES)]
    torch.manual_seed(0)
    if fsdp:
        model = Model(checkpointed)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(Model(checkpointed))
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=1e-4)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    state = {"next": 0, "loss": float("nan")}

    def run(n):
        for _ in range(n):
            x, y = batches[state["next"] % BATCHES]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            state["loss"] = loss.item()
            state["next"] += 1

    run(args.warmup)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        run(args.steps)
        times.append(time.perf_counter() - start)
    params = list(model.parameters())
    local = opt.optim if zero else opt
    optimizer_state = [v for s in local.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim() > 0]
    mib = 1 << 20
    parameters_mb = tensor_bytes(params) / mib
    gradients_mb = tensor_bytes(p.grad for p in params if p.grad is not None) / mib
    optimizer_mb = tensor_bytes(optimizer_state) / mib
    loss = torch.tensor([state["loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    m = statistics.median(times)
    # DDP's reducer sits in reference cycles: collected before the group is
    # destroyed, its Gloo threads are not torn down unjoined (see bench_ddp.py).
    del model, opt, local
    gc.collect()
    dist.barrier()
    if rank == 0:
        RESULT_STREAM.write(json.dumps({
            "variant": args.variant,
            "steps": args.steps,
            "repeats_s": times,
            "steps_per_s": args.steps / m,
            "parameters_mb": parameters_mb,
            "gradients_mb": gradients_mb,
            "optimizer_mb": optimizer_mb,
            "state_mb": parameters_mb + gradients_mb + optimizer_mb,
            "final_loss": loss.item() / dist.get_world_size(),
            "peak_rss_mb": common.peak_rss_mb(),
            "versions": {"torch": torch.__version__},
        }) + "\n")
        RESULT_STREAM.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
