"""Context parallelism in the cluster planner (parallel_lab/plan/cluster/context.py): the layout's
refusals, a cp rank's activations, the ring's and Ulysses' bytes against the local planner's
(strategies/cp/rules.py), the load-balanced causal ring's FLOPs and what the ring exposes, each
against a hand computation in the test."""

from __future__ import annotations

import dataclasses

import pytest

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import context
from parallel_lab.plan.cluster.hardware import from_spec
from parallel_lab.plan.cluster.shape import ModelShape
from parallel_lab.plan.cluster.steptime import ClusterRun, memory_parts, predict
from parallel_lab.strategies.mesh import MeshDims
from parallel_lab.strategies.planning import ClusterLayout

SMALL = ModelShape(layers=4, hidden=256, heads=8, kv_heads=2, ffn=1024, seq=4096, vocab=1000)
CLUSTER = ["model=gpt", "model.preset=llama3_8b", "plan.hardware=h100_sxm", "plan.gpus=64"]


def _run(shape: ModelShape, cp: int, impl: str = "ring", tp: int = 1, recompute: str = "none") -> ClusterRun:
    dims = MeshDims(replicate=64 // (cp * tp), cp=cp, tp=tp)
    layout = ClusterLayout(dims=dims, microbatches=1)
    return ClusterRun(shape, from_spec("h100_sxm"), layout, 64 // (cp * tp), recompute=recompute, cp_impl=impl)


def _cluster_run(*more: str):
    from parallel_lab.config import compose_config
    from parallel_lab.plan.cluster.layout import cluster_run

    args = [*CLUSTER, "trainer.global_batch=64", *more]
    return cluster_run(compose_config(args), args)


def test_cp_layout_refusals_are_one_line():
    """cp x tp must divide the GPUs, the ring's 2cp chunks the sequence, Ulysses' cp a tp rank's
    kv heads: each refused in one line naming the values and the fix."""
    cases = {
        ("strategy=fsdp", "strategy.cp=3"): "strategy.cp=3 x strategy.tp=1 x pp 1 = 3 does not divide plan.gpus=64",
        ("strategy=fsdp", "strategy.cp=8", "model.seq=1000"): "model.seq=1000 does not split into 2 x strategy.cp=8",
        ("strategy=fsdp", "strategy.cp=2", "strategy.tp=8", "strategy.cp_impl=ulysses"): "heads of the 1 kv_heads",
        ("strategy=ddp", "strategy.cp=16", "strategy.cp_impl=ulysses"): "whole heads of the 8 kv_heads",
    }
    for args, message in cases.items():
        with pytest.raises(ConfigError) as info:
            _cluster_run(*args)
        assert message in str(info.value) and "\n" not in str(info.value), args


def test_fsdp_shards_over_shard_x_cp():
    """torchtitan's layout: fully_shard over shard x cp, so 64 GPUs at cp 4 shard the model state 64
    ways (not 16), and the gradients are averaged over every rank."""
    run = _cluster_run("strategy=fsdp", "strategy.cp=4")
    dims = run.layout.dims
    assert (dims.shard, dims.cp, dims.world) == (16, 4, 64) and run.layout.shard_ways == 64
    assert run.grad_ranks == 64 and run.dp == 16
    optimizer = memory_parts(run)["model_state_optimizer"]
    assert optimizer == run.shape.params() * 12 // 64
    run = _cluster_run("strategy=fsdp", "strategy.cp=8", "strategy.tp=8", "trainer.grad_accum=8")  # shard 1
    assert (run.layout.dims.shard, run.layout.shard_stage, run.layout.shard_ways) == (1, 3, 8)


def test_activations_divided_by_cp_against_hand_computation():
    """A cp rank's bytes: Korthikanti et al.'s sbh(34 + 5as/h) per layer at s/cp tokens, the ring
    keeping no scores, Ulysses its heads/cp heads' (5 a s^2 b / cp), the loss's fp32 logits of its
    s/cp tokens (3 x 4 bytes x V each)."""
    s, b, h, a, v, layers, cp = 4096, 1, 256, 8, 1000, 4, 4
    logits = 3 * 4 * (s // cp) * b * v
    ring = layers * (s // cp) * b * h * 34 + logits
    ulysses = layers * ((s // cp) * b * h * 34 + 5 * a * s * s * b // cp) + logits
    whole = layers * s * b * h * (34 + 5 * a * s / h) + 3 * 4 * s * b * v
    assert memory_parts(_run(SMALL, cp, "ring"))["activations"] == ring
    assert memory_parts(_run(SMALL, cp, "ulysses"))["activations"] == ulysses
    assert predict(_run(SMALL, cp, "deepspeed")) == predict(_run(SMALL, cp, "ulysses"))  # DeepSpeed's Ulysses
    assert memory_parts(_run(SMALL, 1))["activations"] == int(whole)


def _local_cp_bytes(impl: str) -> tuple[dict, dict]:
    """strategies/cp/rules.py's bytes per step for a tiny gpt at cp 2 (fp32, as the CPU runs send)."""
    from parallel_lab.config import compose_config
    from parallel_lab.models.gpt_sizes import gpt_sizes
    from parallel_lab.strategies.cp.rules import context_comm

    cfg = compose_config(["model=gpt", "data=tokens", "strategy=ddp", "strategy.cp=2", f"strategy.cp_impl={impl}"])
    cfg.world_size = 2
    return context_comm(cfg, None, 1), gpt_sizes(cfg.model)


def test_ring_and_ulysses_bytes_agree_with_the_local_planner():
    """Per block and micro-batch: the ring sends (cp - 1) K/V blocks forward and (cp - 1) K/V plus
    (cp - 1) dK/dV backward, K = b (s/cp) kv_heads head_dim bytes; Ulysses hands its all-to-alls
    2Q + 2K forward and again backward. Summed over the blocks and the step's micro-batch they are
    what the local planner predicts for the same tiny gpt (fp32: 4 bytes)."""
    for impl in ("ring", "ulysses"):
        local, sizes = _local_cp_bytes(impl)
        shape = ModelShape(
            layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"], kv_heads=sizes["kv_heads"],
            ffn=sizes["ffn"], seq=sizes["seq"], vocab=sizes["vocab"],
        )  # fmt: skip
        from parallel_lab.config import compose_config

        batch = compose_config(["model=gpt"]).trainer.global_batch  # one data-parallel rank, no accumulation
        cp, width = 2, 4
        k = batch * (shape.seq // cp) * shape.kv_heads * (shape.hidden // shape.heads) * width
        q = batch * (shape.seq // cp) * shape.hidden * width
        if impl == "ring":
            sent = context.ring_bytes(shape, batch, cp, 1, width, "none")
            assert sent == {"forward": (cp - 1) * 2 * k, "backward": 2 * (cp - 1) * 2 * k}
            assert shape.layers * (sent["forward"] + sent["backward"]) == local["isend"]
        else:
            handed = context.ulysses_bytes(shape, batch, cp, 1, width, "none")
            assert handed == 2 * (2 * q + 2 * k) and shape.layers * handed == local["all_to_all_single"]


def test_zigzag_ring_flops_are_balanced():
    """The load-balanced causal ring (rank r holds chunks r and 2cp-1-r of 2cp): counting the chunk
    pairs each rank's explicit products compute (its own block: 3 of 4 pairs; every other block
    half of its 4), every rank does the same (2cp + 1)/(4cp^2) of the full square; the GEMMs run
    on tokens/cp."""
    from parallel_lab.plan.cluster.census import block_ops

    for cp in (2, 4, 8):
        chunks = 2 * cp
        work = []
        for r in range(cp):
            mine = {r, chunks - 1 - r}
            pairs = 0
            for s in range(cp):
                keys = {s, chunks - 1 - s}
                pairs += sum(1 for qc in mine for kc in keys if kc <= qc) if s != r else 3
            work.append(pairs)
        assert len(set(work)) == 1
        assert work[0] / chunks**2 == pytest.approx(context.core_share(cp, "ring", fused=False))
    ops = block_ops(SMALL, 1)
    rank = context.rank_ops(ops, SMALL, 1, 4, "ring")
    core, core_rank = (sum(o.flops for o in x if o.attention_core) for x in (ops, rank))
    gemm, gemm_rank = (sum(o.flops for o in x if o.kind == "gemm") for x in (ops, rank))
    assert core_rank == pytest.approx(core * 9 / 64) and gemm_rank == pytest.approx(gemm / 4)
    assert {o.m for o in rank if o.kind == "gemm" and o.phase == "fwd"} == {SMALL.seq // 4}


def test_ring_hops_hide_behind_the_attention_core():
    """Each of the cp - 1 hops is in flight while the rank attends to the block it holds (1/cp of its
    attention core): exposed only beyond that. Across nodes (cp 16 of 8-GPU nodes) a hop of the K/V
    block takes latency + bytes / (Gb/s / 8 x efficiency); hand-computed here for a slow link."""
    hw = from_spec("h100_sxm;inter_node_gbps=1;link_efficiency=1")
    shape, cp, width = SMALL, 16, 2
    kv = 2 * 1 * (shape.seq // cp) * shape.kv_heads * shape.head_dim * width
    hop_f = 10e-6 + kv / (1 / 8 * 1e9)
    hop_b = 10e-6 + 2 * kv / (1 / 8 * 1e9)
    core = (1e-4, 2e-4)
    dims = MeshDims(replicate=4, cp=cp)
    got = context.exposed_s(hw, shape, 1, dims, "ring", width, "none", core)
    assert got == pytest.approx((cp - 1) * (hop_f - core[0] / cp + hop_b - core[1] / cp))
    assert context.exposed_s(hw, shape, 1, dims, "ring", width, "none", (1e3, 1e3)) == 0.0
    q = 1 * (shape.seq // cp) * shape.hidden * width  # Ulysses: 8 all-to-alls in line, whatever the compute
    handed = 2 * (2 * q + kv)
    ulysses = context.exposed_s(hw, shape, 1, dims, "ulysses", width, "none", (1e3, 1e3))
    assert ulysses == pytest.approx(8 * 10e-6 + (cp - 1) / cp * handed / (1 / 8 * 1e9))
    fast = _run(SMALL, 4)  # inside a node, on NVLink: hidden; the step prices cp's part as tp's
    pred = predict(fast)
    assert pred.cp_comm_s == 0.0 and pred.tp_comm_s == 0.0


def test_published_cp_row_is_held_out():
    """bench published's table holds Llama 3's CP16 row (Table 4), held out, its degrees
    multiplying to its GPUs, with the fit set still at most a third of the rows."""
    from parallel_lab.bench.published import FITTED, TABLE, read_rows, run_of

    rows = read_rows(TABLE)
    (row,) = [r for r in rows if r.cp]
    assert row.name not in FITTED and 3 * len(FITTED) <= len(rows)
    assert "Table 4" in row.source and row.measured_tflops_per_gpu == "380"
    run = run_of(row, from_spec(row.hardware))
    assert run.layout.dims.cp == 16 and run.gpus == 16384 and run.shape.seq == 131072


def test_recommender_ranks_cp_as_its_own_command_plans_it():
    """At a long sequence the recommender ranks ddp, fsdp and tp at each cp degree too, and a cp
    candidate's prediction is what planning its printed command alone gives; below LONG_SEQ none."""
    from parallel_lab.config import compose_config
    from parallel_lab.plan.cluster.layout import cluster_run
    from parallel_lab.plan.cluster.recommend import other_strategies

    given = ["model=gpt", "model.preset=generic_1.3b", "model.seq=32768", "plan.hardware=h100_sxm", "plan.gpus=4"]
    given += ["trainer.global_batch=4", "plan.fused_attention=true"]
    candidates = other_strategies(compose_config(given), given, 4)
    with_cp = {c.command: c for c in candidates if "strategy.cp=" in c.command}
    assert {c.split()[0] for c in with_cp} == {"strategy=ddp", "strategy=fsdp", "strategy=tp"}
    assert {c.run.layout.dims.cp for c in with_cp.values()} == {2, 4}
    command = next(c for c in with_cp if c.startswith("strategy=fsdp") and "strategy.cp=4" in c)
    args = [*given, *command.split()]
    alone = predict(cluster_run(compose_config(args), args))
    assert with_cp[command].prediction == alone
    assert context.degrees(dataclasses.replace(SMALL, seq=context.LONG_SEQ // 2), 64) == [1]
