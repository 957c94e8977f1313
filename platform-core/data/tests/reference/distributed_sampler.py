"""Reference for kiln_data::DistributedSampler and kiln_core::rng::torch_randperm.

Usage: python distributed_sampler.py CASES_JSON
       python distributed_sampler.py --large-randperm N SEED

CASES_JSON is one JSON object
    {"samplers": [{"n", "num_replicas", "rank", "shuffle", "seed", "epoch", "drop_last"}],
     "randperm": [{"n", "seed"}]}
and the script prints one JSON object
    {"torch": VERSION,
     "samplers": [{"indices", "len"}],   # list(sampler) after set_epoch(epoch), len(sampler)
     "randperm": [[...]]}                # torch.randperm(n, generator=manual_seed(seed))
in the order of the cases.

With --large-randperm it prints {"n", "head", "tail", "strided"} for
torch.randperm(N) under manual_seed(SEED): the first and last 1000 entries and
every 1,000,003rd entry, to check the branch ATen takes for very large N without
printing hundreds of millions of numbers.
"""

import json
import sys

import torch
from torch.utils.data import DistributedSampler


def randperm(n, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def sampler_case(case):
    sampler = DistributedSampler(
        range(case["n"]),
        num_replicas=case["num_replicas"],
        rank=case["rank"],
        shuffle=case["shuffle"],
        seed=case["seed"],
        drop_last=case["drop_last"],
    )
    sampler.set_epoch(case["epoch"])
    return {"indices": list(sampler), "len": len(sampler)}


def main():
    if sys.argv[1] == "--large-randperm":
        n, seed = int(sys.argv[2]), int(sys.argv[3])
        perm = randperm(n, seed)
        print(
            json.dumps(
                {
                    "n": n,
                    "head": perm[:1000].tolist(),
                    "tail": perm[-1000:].tolist(),
                    "strided": perm[::1_000_003].tolist(),
                }
            )
        )
        return
    cases = json.loads(sys.argv[1])
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "samplers": [sampler_case(c) for c in cases["samplers"]],
                "randperm": [randperm(c["n"], c["seed"]).tolist() for c in cases["randperm"]],
            }
        )
    )


if __name__ == "__main__":
    main()
