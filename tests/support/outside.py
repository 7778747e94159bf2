"""Checkpoints written with the real libraries and no code of this toolkit (trainer.init_from's
inputs, tests/integration/test_init_from.py): a plain torch loop over the same model and data
(models and data are single-device code by design, as in reference.py), saved by torch.save,
safetensors or torch DCP; a plain DeepSpeed script (deepspeed_writer.py) writes its own."""

from __future__ import annotations

import copy

import torch

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.models.cnn import SmallCNN
from tests.support.reference import global_batches


def plain_adam(steps: int, init: dict | None = None, data_size: int = 96, batch: int = 32, seed: int = 0):
    """SmallCNN trained `steps` Adam steps (lr 1e-3) from the start of the data, optionally from
    init = {"model": state_dict, "optimizer": state_dict (optional)}; returns (losses, net, opt)."""
    torch.manual_seed(seed)
    net = SmallCNN()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=False)
    if init:
        init = copy.deepcopy(init)  # Optimizer.load_state_dict keeps the tensors it is given, and steps them in place
        net.load_state_dict(init["model"])
        if "optimizer" in init:
            opt.load_state_dict(init["optimizer"])
    data, order, losses = make_synthetic(data_size, seed), global_batches(data_size, batch, seed), []
    for _ in range(steps):
        idx = next(order)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(data.tensors[0][idx]), data.tensors[1][idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, net, opt
