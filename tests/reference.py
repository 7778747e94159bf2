"""An independent single-process reference, written with plain torch and nothing of the
toolkit's training code: the model class and the synthetic data generator are shared (they are
single-device code by design), the batch order and training loop are re-implemented here."""
from __future__ import annotations

import torch

from parallel_lab.data.synthetic import make_synthetic
from parallel_lab.models.cnn import SmallCNN
from parallel_lab.models.resnet import ResNet18

MODELS = {"cnn": SmallCNN, "resnet18": ResNet18}


def global_batches(size: int, global_batch: int, seed: int):
    """What every strategy must see: epoch e's permutation is randperm(seed + e), cut in order."""
    epoch = 0
    while True:
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, size - global_batch + 1, global_batch):
            yield order[start:start + global_batch]
        epoch += 1


def reference_run(model: str = "cnn", steps: int = 4, global_batch: int = 32, lr: float = 1e-3, seed: int = 0,
                  optimizer: str = "adam", data_size: int = 4096, grad_accum: int = 1, threads: int = 2):
    """Plain training loop: returns (per-step losses, final parameter checksum, final model)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    net = MODELS[model]()
    data = make_synthetic(data_size, seed)
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr, foreach=False)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses, batches = [], global_batches(data_size, global_batch, seed)
    for _ in range(steps):
        idx = next(batches)
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    checksum = float(sum(p.detach().double().sum().item() for p in net.parameters()))
    return losses, checksum, net
