"""Distributed test bodies for tensor parallelism (run with parallel_lab.cli.run.run_ranks by
tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import torch
from torch import nn

from parallel_lab.strategies.tp.comm import copy_to_tp, reduce_from_tp
from parallel_lab.strategies.tp.layers import ColumnParallel, RowParallel
from tests.support.matrix import each_configuration


def _same_on_all_ranks(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def collectives_body(rank: int, world_size: int) -> None:
    """f and g, forward and backward, against the dense (single-device) computation."""
    n, d_in, d_out = 4, 6, 2 * world_size
    x_full = _same_on_all_ranks(n, d_in, seed=1)
    w = _same_on_all_ranks(d_out, d_in, seed=2)
    upstream = _same_on_all_ranks(n, d_out, seed=3)  # d(loss)/d(output) of the dense layer

    # Dense reference: y = x W^T, with loss = sum(y * upstream).
    x_dense = x_full.clone().requires_grad_()
    y_dense = x_dense @ w.T
    (y_dense * upstream).sum().backward()

    # f: column split of W (rank r computes output columns r*k..). Forward is the identity, and
    # backward must SUM the ranks' partial input gradients to give the dense one.
    k = d_out // world_size
    cols = slice(rank * k, (rank + 1) * k)
    x = x_full.clone().requires_grad_()
    entered = copy_to_tp(x)
    assert torch.equal(entered, x), "f forward must be the identity"
    y_local = entered @ w[cols].T
    assert torch.allclose(y_local, y_dense[:, cols])
    (y_local * upstream[:, cols]).sum().backward()
    assert torch.allclose(x.grad, x_dense.grad, atol=1e-12), "f backward must all-reduce the input gradient"

    # g: row split of W over input features (rank r holds input columns r*j..). Forward must sum
    # the partial outputs; backward must pass the upstream gradient through unchanged.
    j = d_in // world_size
    rows = slice(rank * j, (rank + 1) * j)
    x_part = x_full[:, rows].clone().requires_grad_()
    partial = (x_part @ w[:, rows].T).detach().requires_grad_()
    out = reduce_from_tp(partial)
    assert torch.allclose(out, y_dense.detach(), atol=1e-12), "g forward must all-reduce the partial sums"
    (out * upstream).sum().backward()
    assert torch.equal(partial.grad, upstream), "g backward must be the identity"


def mlp_body(rank: int, world_size: int) -> None:
    """ColumnParallel then RowParallel (the cnn head, and a conv pair) equal the dense layers:
    output, input gradient and each rank's slice of every weight gradient."""
    for dense1, dense2, shape in (
        (nn.Linear(12, 8), nn.Linear(8, 5), (3, 12)),
        (nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 6, 3, padding=1), (2, 3, 6, 6)),
    ):
        torch.manual_seed(0)  # identical weights and input on every rank
        for layer in (dense1, dense2):
            layer.reset_parameters()
        x = torch.randn(*shape)
        xd = x.clone().requires_grad_()
        dense_out = dense2(torch.relu(dense1(xd)))
        dense_out.pow(2).sum().backward()

        col = ColumnParallel(dense1, None, rank, world_size)
        row = RowParallel(dense2, None, rank, world_size, input_is_split=True)
        xp = x.clone().requires_grad_()
        out = row(torch.relu(col(xp)))
        out.pow(2).sum().backward()
        assert torch.allclose(out, dense_out, atol=1e-5), f"{type(dense1).__name__}: forward differs"
        assert torch.allclose(xp.grad, xd.grad, atol=1e-5), f"{type(dense1).__name__}: input gradient differs"
        half1 = dense1.weight.shape[0] // world_size
        half2 = dense2.weight.shape[1] // world_size
        assert torch.allclose(col.weight.grad, dense1.weight.grad[rank * half1 : (rank + 1) * half1], atol=1e-5)
        assert torch.allclose(col.bias.grad, dense1.bias.grad[rank * half1 : (rank + 1) * half1], atol=1e-5)
        assert torch.allclose(row.weight.grad, dense2.weight.grad[:, rank * half2 : (rank + 1) * half2], atol=1e-5)
        assert torch.allclose(row.bias.grad, dense2.bias.grad, atol=1e-5)


def row_only_body(rank: int, world_size: int) -> None:
    """A row-parallel layer fed a replicated input (resnet18's head) equals the dense layer."""
    torch.manual_seed(0)
    dense = nn.Linear(8, 3)
    x = torch.randn(4, 8)
    xd = x.clone().requires_grad_()
    dense(xd).pow(2).sum().backward()
    row = RowParallel(dense, None, rank, world_size, input_is_split=False)
    xp = x.clone().requires_grad_()
    out = row(xp)
    out.pow(2).sum().backward()
    assert torch.allclose(out, dense(x), atol=1e-6)
    assert torch.allclose(xp.grad, xd.grad, atol=1e-6), "the replicated input needs the whole gradient"


def autograd_collectives_body(rank: int, world_size: int) -> None:
    """All collective-level checks in one set of ranks (process start-up dominates their cost)."""
    collectives_body(rank, world_size)
    mlp_body(rank, world_size)
    row_only_body(rank, world_size)


def strategy_matrix_body(
    rank: int, world_size: int, configs: dict[str, list[str]], steps: int, global_batch: int
) -> None:
    """Each configuration trains through the real loop; losses, gathered parameters and eval
    accuracy must match the single-process reference; each rank must hold only its shards.
    Prints each configuration's result on this rank (tests/support/matrix.py)."""

    def holds_only_its_shards(overrides, metrics, strategy, ref) -> None:
        full_bytes = 4 * sum(p.numel() for p in ref.params.values())
        held = metrics.ranks[rank]["param_bytes"]
        assert held < full_bytes, f"{overrides}: rank {rank} holds {held} bytes, the full model is {full_bytes}"

    base = ["strategy=tp", f"world_size={world_size}", f"strategy.tp={world_size}"]
    each_configuration(configs, steps, global_batch, base, holds_only_its_shards)
