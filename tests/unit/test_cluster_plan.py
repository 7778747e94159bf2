"""The cluster planner (parallel_lab/plan/cluster): each formula against an independent hand
computation in the test, the profiles and their one-line refusals, plan.json's fields."""

from __future__ import annotations

import json

import pytest

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import comm, memory
from parallel_lab.plan.cluster.hardware import from_spec
from parallel_lab.plan.cluster.shape import ModelShape

GPT3 = ModelShape(layers=96, hidden=12288, heads=96, kv_heads=96, ffn=4 * 12288, seq=2048, vocab=51200)


def test_ring_collectives_against_hand_computation():
    """An 8-GPU all-reduce of 1 GB inside a node, and one of 16 ranks 64 apart across nodes."""
    hw = from_spec("a100_80g")
    nvlink = 300e9 * hw.link_efficiency
    assert comm.all_reduce_s(hw, 1e9, 8, 1) == pytest.approx(14 * 5e-6 + 1.75e9 / nvlink)
    nic = 200e9 / 8 * hw.link_efficiency
    assert comm.all_reduce_s(hw, 1e9, 16, 64) == pytest.approx(30 * 10e-6 + (30 / 16) * 1e9 / nic)
    assert comm.all_gather_s(hw, 8e8, 4, 2) == pytest.approx(3 * 5e-6 + 0.75 * 8e8 / nvlink)
    assert comm.send_s(hw, 1e6, 8) == pytest.approx(10e-6 + 1e6 / nic)  # neighbours 8 apart: another node
    assert comm.all_reduce_s(hw, 1e9, 1, 1) == 0.0


def test_activations_against_korthikanti_table2():
    """Per-layer bytes of Korthikanti et al. (arXiv 2205.05198) Table 2, written out here."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    cases = {
        (1, False, "none"): sbh * (34 + 5 * a * s / h),
        (t, False, "none"): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        (t, True, "none"): sbh * (34 / t + 5 * a * s / (h * t)),
        (t, False, "selective"): sbh * (10 + 24 / t),
        (t, True, "selective"): sbh * 34 / t,
        (1, False, "full"): 2 * sbh,
    }
    for (tp, sp, recompute), want in cases.items():
        got = memory.layer_activation_bytes(GPT3, b, tp, sp, recompute, flash=False)
        assert got == pytest.approx(want), (tp, sp, recompute)


def test_model_state_zero_stages():
    """ZeRO's per-GPU bytes (arXiv 1910.02054 section 5: 2+2+12 per parameter, Nd ways)."""
    kind = memory.state_bytes("bf16", "adam")
    psi, nd = 7_500_000_000, 64
    assert sum(memory.model_state(psi, kind, 0, nd).values()) == 16 * psi
    assert sum(memory.model_state(psi, kind, 1, nd).values()) == 4 * psi + 12 * psi // nd
    assert sum(memory.model_state(psi, kind, 2, nd).values()) == 2 * psi + 2 * psi // nd + 12 * psi // nd
    assert sum(memory.model_state(psi, kind, 3, nd).values()) == 3 * (psi * 2 // nd) + 10 * psi // nd


def test_hardware_profiles_and_refusals():
    hw = from_spec("h100_sxm;inter_node_gbps=800")
    assert hw.inter_node_gbps == 800 and hw.peak_flops("bf16") == 989e12
    with pytest.raises(ConfigError, match="unknown hardware 'a100_81g'; choose one of: a100_40g"):
        from_spec("a100_81g")
    with pytest.raises(ConfigError, match="bad hardware override"):
        from_spec("a100_80g;inter_node_gpbs=800")
    from parallel_lab.config import compose_config

    with pytest.raises(ConfigError) as info:
        compose_config(["plan.hardware=h100"])
    assert "unknown plan.hardware 'h100'" in str(info.value) and "\n" not in str(info.value)
    cfg = compose_config(["plan.hardware=a100_80g", "plan.hardware.inter_node_gbps=800"])
    assert cfg.plan.hardware.inter_node_gbps == 800 and cfg.plan.hardware.peak_tflops.bf16 == 312


def test_plan_json_fields(tmp_path):
    """The issue's example command writes plan.json with its fields, the parts summing to the
    step, the pipeline's stages derived from plan.gpus, planned in bf16 (no precision given)."""
    from parallel_lab.plan.main import run

    run(
        [
            "model=gpt",
            "model.preset=gpt3_175b",
            "plan.hardware=a100_80g",
            "plan.gpus=1024",
            "strategy=pp",
            "strategy.tp=8",
            "strategy.replicate=16",
            "strategy.virtual_stages=2",
            "strategy.microbatches=96",
            "trainer.recompute=selective",
            "trainer.global_batch=1536",
            f"plan.out={tmp_path}",
        ]
    )
    data = json.loads((tmp_path / "plan.json").read_text())
    parts = ("compute_s", "tp_comm_s", "bubble_s", "pp_p2p_s", "dp_comm_s", "optimizer_s")
    assert data["step_time_s"] == pytest.approx(sum(data[k] for k in parts))
    assert data["memory_bytes_per_gpu"] == sum(data["memory"].values())
    assert 0 < data["mfu"] < 1 and data["tflops_per_gpu"] > 0 and data["precision"] == "bf16"
    assert data["gpus"] == 1024 and "replicate 16 x pp 8 x tp 8 (interleaved_1f1b, v=2, m=96)" in data["layout"]


def test_published_csv_path(tmp_path, capsys):
    """A user's table (the documented columns, empty cells as defaults) runs the held-out check:
    its last line in the issue's format, every row held out, a bad header one line."""
    from parallel_lab.bench.published import COLUMNS, main

    header = ",".join(COLUMNS)
    row = "mine,{hw},64,8,24,2048,16,,2048,51200,256,1,2,4,,2,true,selective,,,bf16,{it},,"
    path = tmp_path / "runs.csv"
    path.write_text(
        "\n".join([header, row.format(hw="a100_80g", it=2.0), row.format(hw="h100_sxm;inter_node_gbps=800", it=1.0)])
        + "\n"
    )
    assert main(["--csv", str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("held-out: median |error| ") and last.endswith("2 held-out rows from 1 sources, 0 fitted")
    (tmp_path / "bad.csv").write_text("name,gpus\nx,8\n")
    with pytest.raises(SystemExit, match="missing; use exactly: name, hardware"):
        main(["--csv", str(tmp_path / "bad.csv")])


def test_measured_profile_round_trip(tmp_path):
    """bench hardware's writer: the yaml it writes loads as a profile with every value and a
    source comment per field; a profile lacking a field is refused in one line."""
    from parallel_lab.bench.hardware import write_profile
    from parallel_lab.plan.cluster.hardware import FIELDS, from_spec

    values = {
        **{f: 1.0 for f in FIELDS},
        "name": "lab",
        "peak_tflops": {"bf16": 2.5, "fp32": 1.5},
        "attention_efficiency": {"fwd": 0.5, "fwd_causal": 0.4, "bwd": 0.3, "bwd_causal": 0.2},
        "hbm_bytes": 8 << 30,
    }
    values["gpus_per_node"], values["overhead_bytes"] = 4, 1 << 20
    path = write_profile(values, {f: f"measured {f}" for f in FIELDS}, tmp_path / "lab.yaml")
    text = path.read_text()
    assert all(f"# measured {f}" in text for f in FIELDS if f != "name")
    hw = from_spec("a100_80g")  # the shipped ones load too
    assert hw.gpus_per_node == 8
    import yaml

    from parallel_lab.plan.cluster.hardware import from_config

    loaded = from_config(yaml.safe_load(text))
    assert loaded.peak_flops("bf16") == 2.5e12 and loaded.hbm_bytes == 8 << 30 and loaded.gpus_per_node == 4
    assert loaded.attention_efficiency == values["attention_efficiency"]
    del values["link_efficiency"]
    with pytest.raises(ConfigError, match="lacks link_efficiency"):
        write_profile(values, {}, tmp_path / "bad.yaml")
    assert not (tmp_path / "bad.yaml").exists()


def test_published_table_fit_set():
    """bench published fits on named rows of its own table, at most a third of them, each citing its source."""
    from parallel_lab.bench.published import FITTED, TABLE, read_rows

    rows = read_rows(TABLE)
    names = [r.name for r in rows]
    assert set(FITTED) <= set(names) and len(set(names)) == len(names)
    assert 3 * len(FITTED) <= len(rows)
    assert all(r.source for r in rows)


def test_top_pick_beside_the_published_layout():
    """bench published's top-pick line per Table 1 row: the published layout is one of the
    candidates, so our pick (which fits) and our pick among the source's techniques (its full
    recompute, no sequence parallelism) are never slower than it, the latter never faster than the
    former, and "within 10%" compares the published seconds with the pick's."""
    from parallel_lab.bench.published import TABLE, read_rows, top_picks

    rows = [r for r in read_rows(TABLE) if r.name == "narayanan_t1_1.7B"]
    (row,) = top_picks(rows, {})  # the profile's own figures: nothing fitted here
    pick, (own, own_s) = row.pick, row.own
    assert pick.fits and pick.prediction.step_time_s <= own_s <= row.published_s
    assert own.recompute == row.published.recompute == "full" and not own.layout.sequence_parallel
    assert row.within == (row.published_s <= 1.1 * pick.prediction.step_time_s)
    assert row.within_own == (row.published_s <= 1.1 * own_s)


def test_stage_blocks_leave_the_ends_short():
    """Llama 3's 126 layers over 16 stages: one fewer on the first and the last (arXiv 2407.21783 3.3.2)."""
    from parallel_lab.plan.cluster.steptime import stage_blocks

    assert stage_blocks(126, 16) == [7] + [8] * 14 + [7]
    assert stage_blocks(96, 8) == [12] * 8
    assert stage_blocks(9, 2) == [5, 4]  # one short: the last stage (it computes the logits)


LLAMA = ModelShape(
    layers=2, hidden=256, heads=4, kv_heads=2, ffn=768, seq=64, vocab=512, gated=True, tied=False, rotary=True
)


def test_op_policy_keeps_every_other_product():
    """torchtitan's per-operator checkpointing on a Llama block: the block's input, the outputs of
    q, v, gate and fc2 (the 1st, 3rd, 5th and 7th products), the fused attention's output and its
    fp32 log-sum-exp, written out here."""
    import dataclasses

    from parallel_lab.plan.cluster.census import block_ops

    shape = dataclasses.replace(LLAMA, fused_attention=True)
    b, s, h, kv, f = 2, shape.seq, shape.hidden, shape.kv_heads * shape.head_dim, shape.ffn
    tokens = b * s
    want = 2 * tokens * (h + h + kv + f + h + h) + 4 * b * shape.heads * s
    got = memory.op_policy_bytes(block_ops(shape, b), 1, tokens, h, False, 2)
    assert got == want


def test_zero3_gathers_one_module_ahead():
    """DeepSpeed's ZeRO-3 (prefetch.py): each stretch between two gathers lasts the longer of its
    compute and the next gather, so out-of-step modules cost more than max(compute, traffic); a
    module kept for reuse (within 1e9 elements) gathers nothing and joins the stretch before it."""

    from parallel_lab.plan.cluster import prefetch
    from parallel_lab.plan.cluster.census import block_ops
    from parallel_lab.plan.cluster.prefetch import Visit
    from parallel_lab.plan.cluster.steptime import ClusterRun
    from parallel_lab.strategies.mesh import MeshDims
    from parallel_lab.strategies.planning import ClusterLayout

    def traffic(elements: int) -> float:
        return float(elements)

    uneven = [Visit(1.0, 1, True), Visit(3.0, 3, True)]  # by hand: max(1, 3) + max(3, 1), not max(4, 4)
    assert prefetch._stretches(uneven, traffic, lambda e: 0.0) == 6.0
    kept = [Visit(1.0, 1, True), Visit(2.0, 5, False, reduces=True)]  # one stretch: max(1 + 2, 1 + 5)
    assert prefetch._stretches(kept, traffic, traffic) == 6.0

    layout = ClusterLayout(dims=MeshDims(shard=16), shard_stage=3, shard_ways=16, regathers_on_recompute=True)
    hw = from_spec("a100_80g")
    for shape, regathered in ((GPT3, 5), (LLAMA, 0)):  # 175B: only the last linear is reused; a tiny one: all
        run = ClusterRun(shape, hw, layout, 16, "bf16", "full")
        forward, backward, _ = prefetch._visits(block_ops(shape, 1), hw, run, shape.seq)
        assert backward[: len(forward)] == forward  # the recomputed forward gathers what its forward released
        assert sum(v.gathers for v in backward[len(forward) :]) == regathered


def test_memory_parts_logits_and_allocator_reserve():
    """The loss's three fp32 logit copies, and the allocator's reserve on top of every other part."""
    from parallel_lab.plan.cluster.steptime import ClusterRun, memory_parts
    from parallel_lab.strategies.mesh import MeshDims
    from parallel_lab.strategies.planning import ClusterLayout

    assert memory.logits_bytes(GPT3, 2, 8) == 3 * 4 * 2048 * 2 * 51200 / 8
    hw = from_spec("h100_sxm;allocator_slack=0.25")
    parts = memory_parts(ClusterRun(LLAMA, hw, ClusterLayout(dims=MeshDims(replicate=8)), 8))
    reserve = parts.pop("allocator_reserve")
    assert reserve == int(0.25 * sum(parts.values()))


def test_census_counts_no_bytes_for_unmarked_views():
    """matmul's _unsafe_view of a batched product's output is a view: the block's census moves no
    bytes for it (it used to count the attention scores twice more)."""
    from parallel_lab.plan.cluster.census import block_ops

    ops = block_ops(GPT3_SMALL, 1)
    assert not [op for op in ops if op.name in ("_unsafe_view", "empty_like")]
    assert {op.name for op in ops if op.kind == "memory" and op.attention_core and op.phase == "fwd"} == {
        "mul",
        "masked_fill",
        "_softmax",
    }


def test_census_splits_head_parallel_copies_under_tp():
    """Plain tp replicates the residual stream's operators (LayerNorm, the residual adds) on every
    rank but splits the attention's head-parallel copy (its output's transpose) with the heads."""
    from parallel_lab.plan.cluster.census import block_ops

    ops = [op for op in block_ops(GPT3_SMALL, 1) if op.phase == "fwd" and op.kind == "memory"]
    kinds = {op.name: op.token_sized for op in ops if op.name in ("clone", "native_layer_norm", "add")}
    assert kinds == {"clone": False, "native_layer_norm": True, "add": True}
    clone = next(op for op in ops if op.name == "clone")
    assert clone.on_tp_rank(4, 64, False).bytes == clone.bytes / 4


GPT3_SMALL = ModelShape(layers=2, hidden=128, heads=4, kv_heads=4, ffn=512, seq=64, vocab=256)


def test_compose_configs_matches_compose_config():
    """The recommender's batch of composes gives what one compose each gives; a bad one its error."""
    from parallel_lab.config import compose_config
    from parallel_lab.config.compose import compose_configs

    lists = [["strategy=fsdp", "trainer.global_batch=64"], ["strategy=zero3"], ["strategy=nope"]]
    got = compose_configs(lists)
    assert got[0] == compose_config(lists[0]) and got[1] == compose_config(lists[1])
    assert isinstance(got[2], ConfigError) and "nope" in str(got[2])


def test_recommender_prices_fsdp_x_tp_as_its_own_command_plans_it():
    """FSDP2 x TP (torchtitan's 2-D layout) is among the recommender's candidates at every tensor
    degree a node allows, and each candidate's prediction is what planning its printed command alone
    gives (the command line's path: compose, cluster_run, predict)."""
    from parallel_lab.config import compose_config
    from parallel_lab.plan.cluster.layout import cluster_run
    from parallel_lab.plan.cluster.recommend import other_strategies
    from parallel_lab.plan.cluster.steptime import predict

    given = ["model=gpt", "model.preset=generic_7b", "plan.hardware=h100_sxm", "plan.gpus=16"]
    given.append("trainer.global_batch=64")
    candidates = other_strategies(compose_config(given), given, 16)
    fsdp = {c.command: c for c in candidates if c.command.startswith("strategy=fsdp")}
    assert {int(cmd.split("strategy.tp=")[1].split()[0]) for cmd in fsdp if "strategy.tp=" in cmd} == {2, 4, 8}
    assert not any("strategy.tp=1 " in c.command for c in candidates)  # tp=1: the strategy's plain layout
    for command in [next(c for c in fsdp if "strategy.tp=4" in c), next(c for c in fsdp if "strategy.tp" not in c)]:
        args = [*given, *command.split()]
        alone = predict(cluster_run(compose_config(args), args))
        assert fsdp[command].prediction.step_time_s == alone.step_time_s, command
        assert fsdp[command].prediction.memory_bytes_per_gpu == alone.memory_bytes_per_gpu, command


def test_compose_each_strategy_is_hydras_compose_of_each():
    """The recommender's one compose with each strategy's node laid in by hand gives, for every
    registered strategy, what Hydra composes for that strategy=<name> (values, the node's schema
    type, its struct flag); overrides of strategy.* go to Hydra."""
    from omegaconf import OmegaConf

    from parallel_lab.config.compose import _touches_strategy, compose_configs, compose_each_strategy
    from parallel_lab.strategies import registered_names

    names = registered_names()
    given = ["model=gpt", "model.preset=generic_7b", "plan.hardware=h100_sxm", "plan.gpus=16"]
    fast, hydra = compose_each_strategy(given, names), compose_configs([[*given, f"strategy={n}"] for n in names])
    for name, a, b in zip(names, fast, hydra):
        assert OmegaConf.to_yaml(a) == OmegaConf.to_yaml(b), name
        assert OmegaConf.get_type(a.strategy) is OmegaConf.get_type(b.strategy), name
        assert OmegaConf.is_struct(a.strategy) == OmegaConf.is_struct(b.strategy), name
    assert _touches_strategy(["strategy.tp=2"]) and _touches_strategy(["+strategy@x=y"])
    assert not _touches_strategy(given)


def test_block_time_keys_on_every_hardware_field():
    """The memoised block pricing is block_pass of the census's block, and a profile that differs in
    one field (an override) is priced afresh, not served from the cache."""
    from parallel_lab.plan.cluster.census import block_ops
    from parallel_lab.plan.cluster.compute import block_pass
    from parallel_lab.plan.cluster.steptime import block_time

    hw, slow = from_spec("h100_sxm"), from_spec("h100_sxm;peak_tflops.bf16=400")
    args = ("bf16", 2, 4 * GPT3_SMALL.seq, True, "selective")
    for profile in (hw, slow):
        assert block_time(GPT3_SMALL, 4, profile, *args) == block_pass(block_ops(GPT3_SMALL, 4), profile, *args)
    assert block_time(GPT3_SMALL, 4, slow, *args) != block_time(GPT3_SMALL, 4, hw, *args)
