"""Context parallelism's attention (parallel_lab/strategies/cp) on 2 real gloo ranks, each against
plain full attention computed here: ring attention's forward and its own backward (dq, dk, dv),
Ulysses' all-to-alls, DeepSpeed's DistributedAttention, and the bytes each sends; the gpt's causal
attention with grouped-query heads the same way (the load-balanced ring on chunks r and 3-r of 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

B, H, T, D = 2, 4, 8, 3  # tiny: batch, heads, tokens (all ranks), head_dim


def _full(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))  # q, k, v, dout


def _reference() -> tuple[torch.Tensor, ...]:
    """Full attention on one process: output and dq, dk, dv for the upstream gradient dout."""
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_full(0)))
    out = torch.softmax(q @ k.transpose(-2, -1) / D**0.5, dim=-1) @ v
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


KV = 2  # the causal case's kv heads: each serves H / KV = 2 query heads


def _causal_full(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, D), (B, KV, T, D), (B, KV, T, D), (B, H, T, D))
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)  # q, k, v, dout


def _causal_reference() -> tuple[torch.Tensor, ...]:
    """Causal grouped-query attention on one process, written out here: output and dq, dk, dv."""
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_causal_full(1)))
    wide_k, wide_v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
    scores = (q @ wide_k.transpose(-2, -1) / D**0.5).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ wide_v
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _mine(t: torch.Tensor, rank: int, impl: str) -> torch.Tensor:
    """This rank's tokens of a full (B, heads, T, D) tensor: the gpt's pieces (cp/parallelize.py)."""
    from parallel_lab.strategies.cp.parallelize import token_pieces

    return torch.cat([t.narrow(2, start, n) for start, n in token_pieces(T, 2, rank, impl)], dim=2)


def cp_attention_body(rank: int, world_size: int) -> None:
    """This rank's tokens of q, k, v through each cp attention; prints its outputs, grads and bytes."""
    results = {impl: _attend(rank, world_size, impl) for impl in IMPLS}
    results.update({f"causal-{impl}": _attend(rank, world_size, impl, causal=True) for impl in IMPLS})
    print(json.dumps(results))


def _attend(rank: int, world_size: int, impl: str, causal: bool = False) -> dict:
    from parallel_lab.comm.counter import CommCounter
    from parallel_lab.models.gpt import CausalCore
    from parallel_lab.models.vit import AttentionCore
    from parallel_lab.strategies.cp.comm import CPGroup
    from parallel_lab.strategies.cp.parallelize import ContextParallelCore

    if impl == "deepspeed":
        from parallel_lab.strategies.zero.strategy import import_deepspeed

        import_deepspeed().init_distributed(dist_backend="gloo")  # adopts run_ranks' process group

    cp = CPGroup(None, rank, world_size, tuple(range(world_size)))
    if causal:
        mine = [_mine(t, rank, impl).clone() for t in _causal_full(1)]
    else:
        mine = [t.chunk(world_size, dim=2)[rank].clone() for t in _full(0)]
    q, k, v = (t.requires_grad_() for t in mine[:3])
    core = ContextParallelCore((CausalCore if causal else AttentionCore)(D), cp, impl, causal=causal)
    counter = CommCounter().install()
    with counter.counting():
        out = core(q, k, v)
        out.backward(mine[3])
    counter.uninstall()
    tensors = [out.detach(), q.grad, k.grad, v.grad]
    return {"tensors": [t.tolist() for t in tensors], "bytes": dict(counter.bytes_by_op)}


@pytest.fixture(scope="module")
def extensions_dir(tmp_path_factory) -> Path:
    """An empty TORCH_EXTENSIONS_DIR for the ranks: whatever C++ op DeepSpeed builds lands here."""
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="module")
def cp_outputs(extensions_dir) -> list[dict]:
    """Both impls in one set of 2 ranks: each rank's JSON."""
    from parallel_lab.cli.run import run_ranks

    env = {"TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    return [json.loads(o.strip().splitlines()[-1]) for o in run_ranks(cp_attention_body, 2, timeout=120, env=env)]


@pytest.mark.slow
def test_deepspeed_ulysses_builds_no_cpp_op(cp_outputs, extensions_dir):
    """DeepSpeed's comm backend builds its shm C++ op (~55 s) at init_distributed unless imported
    through import_deepspeed (parallel_lab/strategies/zero/strategy.py); the deepspeed impl above
    initialises it, so nothing may have been built."""
    assert cp_outputs and not any(extensions_dir.rglob("*.so")), sorted(map(str, extensions_dir.rglob("*")))


IMPLS = ("ring", "ulysses", "deepspeed")
GPT = ["model=gpt", "data=tokens"]


@pytest.mark.floats
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_cp_attention_is_full_attention_forward_and_backward(cp_outputs, impl):
    """Each rank's output and dq, dk, dv are its tokens' rows of full attention's (float64, to
    rounding); the bytes are the formula's: ring, 1 hop of K/V forward, 1 of K/V and 1 of dK/dV
    backward (cp - 1 = 1 each); Ulysses (ours and DeepSpeed's), 4 all-to-alls each way of one
    (B, H, T/2, D) tensor."""
    ref = _reference()
    outs = [o[impl] for o in cp_outputs]
    block = B * H * (T // 2) * D * 8  # one rank's k (or v), float64
    want = {"isend": 3 * 2 * block} if impl == "ring" else {"all_to_all_single": 8 * block}
    for rank, got in enumerate(outs):
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got["tensors"], ref, strict=True):
            expected = full.chunk(2, dim=2)[rank]
            assert torch.allclose(torch.tensor(mine, dtype=torch.float64), expected, atol=1e-12), (rank, name)
        assert got["bytes"] == want, (rank, got["bytes"], want)


@pytest.mark.floats
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_causal_cp_attention_is_causal_gqa_attention(cp_outputs, impl):
    """The gpt's causal attention with 2 kv heads for 4 query heads: each rank's output and dq, dk,
    dv are its tokens' rows of the one-process causal attention's (the ring's rank r holds chunks r
    and 3-r of 4, Ulysses' the r-th half); the bytes: the ring's 3 hops of K/V blocks kv_heads
    wide (half the queries' bytes), Ulysses' q and output H wide, k and v KV wide, each way."""
    ref = _causal_reference()
    q_bytes, kv_bytes = B * H * (T // 2) * D * 8, B * KV * (T // 2) * D * 8
    want = {"isend": 3 * 2 * kv_bytes} if impl == "ring" else {"all_to_all_single": 2 * (2 * q_bytes + 2 * kv_bytes)}
    for rank, out in enumerate(cp_outputs):
        got = out[f"causal-{impl}"]
        for name, mine, full in zip(("out", "dq", "dk", "dv"), got["tensors"], ref, strict=True):
            expected = _mine(full, rank, impl)
            assert torch.allclose(torch.tensor(mine, dtype=torch.float64), expected, atol=1e-12), (rank, name)
        assert got["bytes"] == want, (rank, got["bytes"], want)


REFUSALS = {  # overrides -> what the one line must name
    "tokens": (["strategy=ddp", "strategy.cp=3", "world_size=3"], ["strategy.cp=3", "64 tokens", "model.patch"]),
    "heads": (["strategy=ddp", "strategy.cp=8", "strategy.cp_impl=ulysses", "world_size=8"], ["model.heads=4"]),
    "model": (["strategy=ddp", "strategy.cp=2", "model=cnn"], ["model=cnn", "use model=vit"]),
    "gpt-seq": (["strategy=ddp", "strategy.cp=2", *GPT, "model.seq=6"], ["model.seq=6", "2 x strategy.cp=2", "4"]),
    "gpt-seq-ulysses": (
        ["strategy=ddp", "strategy.cp=4", "strategy.cp_impl=ulysses", "world_size=4", *GPT, "model.seq=6"],
        ["model.seq=6", "multiple of 4"],
    ),
    "gpt-kv": (
        ["strategy=ddp", "strategy.cp=4", "strategy.cp_impl=ulysses", "world_size=4", *GPT, "model.kv_heads=2"],
        ["model.kv_heads=2", "strategy.cp_impl=ring"],
    ),
    "gpt-fsdp-tp": (  # the gpt's fsdp x tp runs with cp only (fsdp x cp x tp: test_cp_vit.py)
        ["strategy=fsdp", "strategy.tp=2", "world_size=2", *GPT],
        ["model=gpt with strategy.cp > 1", "strategy=tp strategy.tp=2", "strategy.cp=2"],
    ),
    "gpt-fsdp-cp-tp-moe": (
        ["strategy=fsdp", "strategy.cp=2", "strategy.tp=2", "world_size=4", *GPT, "model.moe_experts=4"],
        ["model.moe_experts=4", "model.moe_experts=0"],
    ),
    # strategy=tp strategy.cp (the gpt's, tp/cp_rules.py): what it does not run
    "tp-cp-vit": (["strategy=tp", "strategy.cp=2", "world_size=4"], ["model=vit", "strategy=fsdp strategy.cp=2"]),
    "tp-cp-tp1": (["strategy=tp", "strategy.cp=2", "strategy.tp=1", *GPT], ["strategy.tp=1", "strategy=ddp"]),
    "tp-cp-sp": (
        ["strategy=tp", "strategy.cp=2", "strategy.sequence_parallel=true", "world_size=4", *GPT],
        ["strategy.sequence_parallel=true", "strategy.sequence_parallel=false"],
    ),
    "tp-cp-deepspeed": (
        ["strategy=tp", "strategy.cp=2", "strategy.cp_impl=deepspeed", "world_size=4", *GPT],
        ["strategy.cp_impl=deepspeed", "strategy.cp_impl=ring"],
    ),
    "tp-cp-ulysses-kv": (
        ["strategy=tp", "strategy.cp=2", "strategy.cp_impl=ulysses", "world_size=4", *GPT, "model.kv_heads=2"],
        ["the 1 kv_heads of a tp rank", "strategy.cp_impl=ring"],
    ),
    "tp-cp-world": (["strategy=tp", "strategy.cp=2", *GPT], ["strategy.cp=2", "world_size=4"]),
    "tp-cp-dropout": (
        ["strategy=tp", "strategy.cp=2", "world_size=4", *GPT, "model.dropout=0.1"],
        ["model.dropout=0.1", "model.dropout=0"],
    ),
    "moe": (
        ["strategy=ddp", "strategy.cp=2", "model.moe_experts=4", "model.moe_topk=2"],
        ["model.moe_experts=4", "strategy.cp=1"],
    ),
    "dropout": (["strategy=ddp", "strategy.cp=2", "model.dropout=0.1"], ["model.dropout=0.1", "model.dropout=0"]),
    "world": (["strategy=ddp", "strategy.cp=4", "world_size=2"], ["world_size=2", "world_size=4"]),
    "fsdp1": (["strategy=fsdp", "strategy.cp=2", "strategy.version=1"], ["strategy.version=2"]),
    "no_shard": (["strategy=fsdp", "strategy.cp=2", "strategy.sharding=no_shard"], ["strategy.sharding=full"]),
    "hsdp-degrees": (
        ["strategy=fsdp", "strategy.cp=2", "strategy.sharding=hybrid", "strategy.replicate=4", "world_size=4"],
        ["strategy.replicate=4 x strategy.cp=2", "world_size=4", "divides world_size / strategy.cp = 2"],
    ),
    "hsdp-no-replicate": (
        ["strategy=fsdp", "strategy.cp=2", "strategy.sharding=hybrid", "world_size=4"],
        ["strategy.replicate="],
    ),
    "hsdp-tp": (
        ["strategy=fsdp", "strategy.cp=2", "strategy.tp=2", "strategy.sharding=hybrid", "strategy.replicate=2"],
        ["strategy.tp=2", "strategy.sharding=full"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_cp_refusals_are_one_line_in_the_parent(case):
    """Each configuration cp cannot run is refused while the config is composed, naming the fix."""
    from tests.support.model_parallel import assert_one_line_config_error

    overrides, named = REFUSALS[case]
    strategy, rest = overrides[0].split("=")[1], overrides[1:]
    base = [] if "model=" in " ".join(rest) else ["model=vit"]
    world = [] if "world_size=" in " ".join(rest) else ["world_size=2"]
    assert_one_line_config_error(strategy, [*base, *world, *rest], named)


@pytest.mark.parametrize(
    "impl, variant, accum, replicate",
    [("ring", "gpt_llama", 1, 1), ("ring", "gpt_llama", 2, 1), ("ulysses", "gpt", 1, 1), ("ring", "gpt", 1, 2)],
)
def test_gpt_cp_x_tp_plans_each_ranks_state_and_bytes_as_derived(impl, variant, accum, replicate):
    """strategy=tp strategy.cp=2 strategy.tp=2 on the gpt at world 4 (the planner, on the meta
    device): every rank's parameters are the vocab-parallel split's, derived from the whole gpt's
    shapes, and its bytes tests/support/bodies/cp_tp_gpt.py's formula (the runs measure the same:
    tests/integration/test_cp_vit.py, extra, at replicate 1); its compute about half a tp rank's
    (its seq/cp tokens). strategy.replicate=2 (world 8): each replica's half of the batch, and the
    gradients averaged over the replicas too."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from tests.support.bodies.cp_tp_gpt import cp_tp_gpt_bytes, split_state_elements
    from tests.support.model_parallel import compose_config
    from tests.support.reference import GPT_RUN, GPT_VARIANTS

    sizes = [f"model.{key}={str(value).lower()}" for key, value in GPT_VARIANTS.get(variant, {}).items()]
    common = [*GPT_RUN, *sizes, "strategy=tp", "strategy.tp=2", "trainer.global_batch=16"]
    cfg = compose_config(*common, "strategy.cp=2", f"strategy.cp_impl={impl}", f"world_size={4 * replicate}",
                         f"strategy.replicate={replicate}", f"trainer.grad_accum={accum}")  # fmt: skip
    meta = build_meta_model(cfg.model)
    held = split_state_elements(meta, 2)
    want = cp_tp_gpt_bytes(cfg, held)
    plans = plan_world(cfg, get_strategy_class("tp"), meta)
    assert len(plans) == 4 * replicate
    for rank, plan in enumerate(plans):
        assert plan.state["param_bytes"] == 4 * held, (rank, plan.state)
        assert plan.comm == want, (rank, plan.comm, want)
    tp_share = get_strategy_class("tp").plan.compute_shape(compose_config(*common, "world_size=2"), meta).flop_share
    share = get_strategy_class("tp").plan.compute_shape(cfg, meta).flop_share
    assert tp_share / 2.1 < share < tp_share / 1.9, (share, tp_share)


def test_hsdp_x_cp_lays_out_replicate_shard_cp_and_plans_the_shapes_bytes():
    """strategy=fsdp strategy.sharding=hybrid strategy.replicate=2 strategy.cp=2 at world 8: the mesh
    is replicate 2 x shard 2 x cp 2 (row-major, cp innermost: a cp group is two consecutive ranks,
    fully_shard's shard x cp group the 4 ranks of one replica, a replicate group one rank of each);
    a cp group reads one share of the batch; the planner's state and bytes of every rank equal
    tests/support/fsdp_tp.py's derivation from the vit's shapes (HSDP over the 4 ranks of a
    replica) plus cp_vit.py's ring. The run measures the same at world 4 (test_cp_vit.py, extra)."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.strategies import get_strategy_class
    from tests.support.bodies.cp_vit import cp_bytes
    from tests.support.fsdp_tp import add_bytes, fsdp_tp_state, hsdp_bytes
    from tests.support.model_parallel import compose_config

    world, batch = 8, 16
    cfg = compose_config("model=vit", "strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2",
                         "strategy.cp=2", f"world_size={world}", f"trainer.global_batch={batch}")  # fmt: skip
    fsdp = get_strategy_class("fsdp")
    dims = fsdp.plan.dims(cfg)
    assert (dims.replicate, dims.shard, dims.cp, dims.tp, dims.data_parallel_size) == (2, 2, 2, 1, 4)
    assert [dims.group_ranks(r, "cp") for r in (0, 5)] == [[0, 1], [4, 5]]
    assert [dims.group_ranks(r, "shard") for r in (0, 5)] == [[0, 2], [5, 7]]
    assert dims.group_ranks(5, "replicate") == [1, 5]
    assert [dims.dp_rank(r) for r in range(world)] == [0, 0, 1, 1, 2, 2, 3, 3]
    meta = build_meta_model(cfg.model)
    shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
    want = add_bytes(hsdp_bytes(shapes, 4), cp_bytes("ring", 2, batch // 4, 1))
    for rank in range(world):  # the planner's rules (plan_world's activation counts: 1 s a rank)
        memory, comm = fsdp.plan.predict_memory(cfg, meta, rank), fsdp.plan.predict_comm(cfg, meta, rank)
        state = {key: memory[key] for key in ("param_bytes", "grad_bytes", "optim_bytes")}
        assert state == fsdp_tp_state(shapes, 4, 1, rank % 4), (rank, state)
        assert comm == want, (rank, comm, want)
