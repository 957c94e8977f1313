"""PyTorch DistributedDataParallel reference for tests/ddp_pytorch.rs.

Run as `torchrun --standalone --nproc-per-node=2 ddp_reference.py DIR
[post_local_sgd WARMUP PERIOD]`: reads
DIR/init.safetensors (the MLP's initial weights, written by Kiln) and
DIR/data.safetensors (inputs `x`, labels `y`), trains with the Gloo backend,
DistributedDataParallel, DistributedSampler(shuffle=True, seed) and Adam with
clipping by norm, and has rank 0 write the per-step losses averaged over the
ranks to DIR/losses.json.

With `post_local_sgd WARMUP PERIOD`, DDP runs PyTorch's post-local SGD:
`post_localSGD_hook` (gradients all-reduced for WARMUP iterations, then left
local) and `PostLocalSGDOptimizer` around a `PeriodicModelAverager(PERIOD,
WARMUP)`; rank 0 also writes each rank's final weights' sum of squares.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH = 8
EPOCHS = 2
SEED = 11


def main(directory, local_sgd=None):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5)
    )
    model.load_state_dict(load_file(f"{directory}/init.safetensors"))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    if local_sgd is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        warmup, period = local_sgd
        state = PostLocalSGDState(
            process_group=None,
            subgroup=None,
            start_localSGD_iter=warmup,
            post_local_gradient_allreduce=False,
        )
        ddp.register_comm_hook(state, post_localSGD_hook)
        optimizer = PostLocalSGDOptimizer(
            optim=optimizer,
            averager=PeriodicModelAverager(period=period, warmup_steps=warmup),
        )
    data = load_file(f"{directory}/data.safetensors")
    dataset = TensorDataset(data["x"], data["y"])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    # Each rank's weights: equal under DDP, apart between averagings under
    # post-local SGD.
    squares = torch.tensor([sum(float((p.double() ** 2).sum()) for p in model.parameters())])
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, squares.double())
    if rank == 0:
        with open(f"{directory}/losses.json", "w") as f:
            json.dump(losses, f)
        with open(f"{directory}/squares.json", "w") as f:
            json.dump([float(t) for t in every], f)
    # Without this, DDP's reducer was sometimes destroyed during interpreter
    # shutdown after the process group, aborting the process ("terminate called
    # without an active exception") once the results were written.
    del ddp, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[2] == "post_local_sgd":
        main(sys.argv[1], (int(sys.argv[3]), int(sys.argv[4])))
    else:
        main(sys.argv[1])
