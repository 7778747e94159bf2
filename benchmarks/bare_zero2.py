"""A bare DeepSpeed ZeRO-2 training script: the yardstick for parallel_lab's zero2 overhead.

    torchrun --nproc_per_node 2 benchmarks/bare_zero2.py --steps 20 --global-batch 64

Same model, data shape, optimizer (torch Adam) and batch as `python -m parallel_lab strategy=zero2`;
gradient clipping off as in parallel_lab's default. Prints one JSON line with the median samples/s.
"""

import argparse
import json
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from parallel_lab.models.cnn import SmallCNN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    config = {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.global_batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        # The toolkit's zero2 settings (parallel_lab/strategies/zero/ds_config.py): 25 MiB buckets
        # (in fp32 elements) and no step logging, so both sides do the same work per step.
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 25 * 2**20 // 4,
            "allgather_bucket_size": 25 * 2**20 // 4,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = TensorDataset(torch.randn(4096, 3, 32, 32), torch.randint(0, 10, (4096,)))
    sampler = DistributedSampler(data, world, rank, seed=0, drop_last=True)
    loader = iter(DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True))
    times = []
    for _ in range(args.steps):
        inputs, targets = next(loader)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[args.warmup :])
    if rank == 0:
        print(json.dumps({"script": "bare_zero2", "samples_per_s": args.global_batch / step, "step_time_s": step}))
    del engine, model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
