"""A bare torch DDP training script: the yardstick for parallel_lab's own overhead.

    torchrun --nproc_per_node 2 benchmarks/bare_ddp.py --steps 20 --global-batch 64

Same model, data shape, optimizer and batch as `python -m parallel_lab strategy=ddp`; prints one
JSON line with the median samples/s after warm-up steps.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from parallel_lab.models.cnn import SmallCNN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # The toolkit's ddp defaults (parallel_lab/strategies/ddp.py): gradients live in the buckets
    # (no copy into them and back each step), 25 MiB buckets. Without them this script did more work
    # per step than the toolkit and the overhead bench read 1.2x "faster than bare".
    model = DistributedDataParallel(SmallCNN(), bucket_cap_mb=25.0, gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    data = TensorDataset(torch.randn(4096, 3, 32, 32), torch.randint(0, 10, (4096,)))
    sampler = DistributedSampler(data, world, rank, seed=0, drop_last=True)
    loader = iter(DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True))
    times = []
    for _ in range(args.steps):
        inputs, targets = next(loader)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[args.warmup :])
    if rank == 0:
        print(json.dumps({"script": "bare_ddp", "samples_per_s": args.global_batch / step, "step_time_s": step}))
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
