"""A plain DeepSpeed training script (no code of this toolkit but the model and the data, which
are single-device code): ``torchrun --nproc_per_node=W deepspeed_writer.py <stage> <out>`` trains
SmallCNN 2 Adam steps over the same batches as tests/support/outside.py::plain_adam (each rank its
contiguous share of the global batch) and ends with ``engine.save_checkpoint(out)``. Written for
trainer.init_from's tests (tests/integration/test_init_from.py); gloo on CPU."""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import torch.distributed as dist

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.models.cnn import SmallCNN
from tests.support.reference import global_batches

STEPS, BATCH, DATA = 2, 32, 96


def main(stage: int, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = SmallCNN()
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
    }
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    data, order = make_synthetic(DATA, 0), global_batches(DATA, BATCH, 0)
    share = BATCH // world
    for _ in range(STEPS):
        idx = next(order)[rank * share : (rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(engine(data.tensors[0][idx]), data.tensors[1][idx])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    dist.barrier()
    # The files are written (CPU saves are synchronous). A normal interpreter exit sometimes aborts
    # ("terminate called without an active exception": a native thread torn down at exit, seen
    # once in ~10 runs), which would make torchrun report a failure; end the process here instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
