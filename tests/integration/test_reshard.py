"""trainer.reshard=true: a checkpoint written by one strategy at one world size continues under
another (checkpoint/full_state.py, State.load_full).

Exactness: the source checkpoint and the target's own checkpoint written right after loading are
read back as full states (parameters, Adam's exp_avg / exp_avg_sq / step, loop state) and must be
equal bit for bit. Same training (issue 24 item 1): 2 steps under S@W, resharded, 2 more under
S'@W' pass the parity criterion (parallel_lab/report/parity.py) against the uninterrupted single run
of 4 steps; every strategy a source and a target, the world going down and up (extra); a bridge that
swaps Adam's moments or restarts its step counter fails it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parallel_lab.checkpoint import checkpoint_name
from parallel_lab.checkpoint.full_state import consolidate
from parallel_lab.cli.run import load_metrics, run_ranks
from parallel_lab.protocol import load_final_params
from tests.support.bodies.reshard import reshard_and_save, train_resharded
from tests.support.bodies.runs import train_and_record
from tests.support.checks import assert_losses_close
from tests.support.cli import run_cli, write_config
from tests.support.reference import parity_reference

COMMON = ("trainer.global_batch=32", "data.size=96", "trainer.eval_batches=0", "dist_timeout_s=60")
SAVED_AT = 2  # the sources train 2 steps and checkpoint there
TIMEOUT = 300
SOURCES = {  # name: (world_size, overrides)
    "single@1": (1, ("strategy=single",)),
    "zero3@2": (2, ("strategy=zero3",)),
    "fsdp@2": (2, ("strategy=fsdp",)),
    "tp@2": (2, ("strategy=tp",)),
    "pp@2": (2, ("strategy=pp",)),
    "zero1_offload@2": (2, ("strategy=zero1", "strategy.offload=cpu")),
    "ddp@2": (2, ("strategy=ddp",)),
    "hybrid@2": (2, ("strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2")),
    "zero2@2": (2, ("strategy=zero2",)),
    "zero0@2": (2, ("strategy=zero0",)),
    "manual_ddp@2": (2, ("strategy=manual_ddp",)),
    "dp@2": (2, ("strategy=dp",)),
    "fsdp1@2": (2, ("strategy=fsdp", "strategy.version=1")),
    "zero3_offload@2": (2, ("strategy=zero3", "strategy.offload=cpu")),
    "zero1@1": (1, ("strategy=zero1",)),
    "dp@1": (1, ("strategy=dp",)),  # dp is one process (dp@2 above runs two copies of it side by side)
}
TARGETS = {  # name: (world_size, overrides)
    "ddp@1": (1, ("strategy=ddp",)),
    "fsdp@2": (2, ("strategy=fsdp",)),
    "fsdp@1": (1, ("strategy=fsdp",)),  # DCP's load-time resharding from fsdp/hybrid/fsdp1 @2
    "zero1@2": (2, ("strategy=zero1",)),
    "pp@2": (2, ("strategy=pp",)),
    "zero3@2": (2, ("strategy=zero3",)),
    "tp@2": (2, ("strategy=tp",)),
    "single@1": (1, ("strategy=single",)),
    "zero2_offload@2": (2, ("strategy=zero2", "strategy.offload=cpu")),
    "zero3_offload@2": (2, ("strategy=zero3", "strategy.offload=cpu")),
    "zero0@1": (1, ("strategy=zero0",)),
    "hybrid@2": (2, ("strategy=fsdp", "strategy.sharding=hybrid", "strategy.replicate=2")),
    "fsdp1@2": (2, ("strategy=fsdp", "strategy.version=1")),
    "manual_ddp@2": (2, ("strategy=manual_ddp",)),
    "dp@2": (2, ("strategy=dp",)),
    "zero2@1": (1, ("strategy=zero2",)),
    "dp@1": (1, ("strategy=dp",)),
}
# make test: every kind of layout once as a source and once as a target, world down and up.
DEFAULT_PAIRS = [("zero3@2", "ddp@1"), ("single@1", "fsdp@2"), ("tp@2", "zero3@2"), ("fsdp@2", "pp@2")]
EXTRA_PAIRS = [(s, t) for s in SOURCES for t in TARGETS if (s, t) not in DEFAULT_PAIRS]
# Same training (issue 24 item 1): SAVED_AT steps under S@W, resharded, CONTINUED steps under S'@W',
# judged against the uninterrupted single run of SAVED_AT + CONTINUED steps by the parity criterion.
# Every strategy is a source and a target at least once; the world goes 2 -> 1 and 1 -> 2.
CONTINUED = 2
PARITY_DEFAULT = [("zero3@2", "ddp@1")]
PARITY_EXTRA = [
    ("single@1", "fsdp@2"),
    ("zero1@1", "tp@2"),
    ("tp@2", "zero3@2"),
    ("fsdp@2", "pp@2"),
    ("pp@2", "zero1@2"),
    ("ddp@2", "zero2@1"),
    ("dp@1", "manual_ddp@2"),
    ("manual_ddp@2", "dp@1"),
    ("zero0@2", "zero0@1"),
    ("zero2@2", "single@1"),
    ("zero1_offload@2", "zero3_offload@2"),
    ("zero3_offload@2", "zero2_offload@2"),
    ("hybrid@2", "fsdp1@2"),
    ("fsdp1@2", "hybrid@2"),
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The source checkpoints (step 2), trained on demand, each world size in one set of ranks."""
    root = tmp_path_factory.mktemp("sources")
    made: dict[str, Path] = {}

    def get(*names: str) -> dict[str, Path]:
        todo = [n for n in dict.fromkeys(names) if n not in made]
        for world in sorted({SOURCES[n][0] for n in todo}):
            batch = [n for n in todo if SOURCES[n][0] == world]
            paths = [_config(root / _slug(n), world, SOURCES[n][1], f"trainer.steps={SAVED_AT}") for n in batch]
            run_ranks(train_and_record, world, timeout=TIMEOUT, config_paths=paths)
            made.update({n: root / _slug(n) / "checkpoints" / checkpoint_name(SAVED_AT) for n in batch})
        return {n: made[n] for n in names}

    return get


def _slug(name: str) -> str:
    return name.replace("@", "_at_")


def _config(folder: Path, world: int, overrides, *more: str) -> str:
    return write_config(
        folder.with_suffix(".yaml"),
        *overrides,
        f"world_size={world}",
        *COMMON,
        f"trainer.checkpoint_every={SAVED_AT}",
        *more,
    )


def reshard_pairs(tmp_path: Path, source_paths: dict, pairs, broken: str = "") -> dict:
    """Load each source into its target and write it out; returns {(source, target): written folder}."""
    written = {}
    for world in sorted({TARGETS[t][0] for _, t in pairs}):
        batch = [(s, t) for s, t in pairs if TARGETS[t][0] == world]
        paths = []
        for s, t in batch:
            out = tmp_path / f"{_slug(s)}__{_slug(t)}"
            paths.append(
                _config(
                    out,
                    world,
                    TARGETS[t][1],
                    f"trainer.steps={SAVED_AT + 2}",
                    f"trainer.resume={source_paths[s]}",
                    "trainer.reshard=true",
                    f"trainer.checkpoint_dir={out / 'resharded'}",
                )
            )
            written[(s, t)] = out / "resharded" / checkpoint_name(SAVED_AT)
        run_ranks(reshard_and_save, world, timeout=TIMEOUT, config_paths=paths, broken=broken)
    return written


def state_differences(a, b) -> list[str]:
    """Where two full states differ (bit for bit); [] when they are the same."""
    diffs = []
    for name in a.param_names:
        if not torch.equal(a.model[name], b.model[name]):
            diffs.append(f"{name}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if not torch.equal(a.optim[name][key].float(), b.optim[name][key].float()):
                diffs.append(f"{name}.{key}")
    for what in ("step", "batches_consumed", "history"):
        if getattr(a, what) != getattr(b, what):
            diffs.append(what)
    return diffs


def assert_same_state(source: Path, written: Path) -> None:
    diffs = state_differences(consolidate(source), consolidate(written))
    assert not diffs, f"{written}: differs from {source} in {diffs[:6]}"


@pytest.mark.slow
def test_reshard_is_exact(tmp_path, sources):
    """Parameters, Adam state and loop state survive S@W -> S'@W' bit for bit (ZeRO, FSDP,
    replicated and tp/pp each a source and a target; world 2 -> 1 and 1 -> 2)."""
    written = reshard_pairs(tmp_path, sources(*{s for s, _ in DEFAULT_PAIRS}), DEFAULT_PAIRS)
    for (s, t), folder in written.items():
        assert_same_state(sources(s)[s], folder)


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["swap_moments", "step_not_restored"])
def test_exactness_check_catches_a_broken_bridge(tmp_path, sources, broken):
    """The same check fails when Adam's moments are swapped or its step counter is not restored."""
    pair = ("zero3@2", "ddp@1")
    written = reshard_pairs(tmp_path, sources(pair[0]), [pair], broken=broken)
    diffs = state_differences(consolidate(sources(pair[0])[pair[0]]), consolidate(written[pair]))
    expected = "exp_avg" if broken == "swap_moments" else "step"
    assert any(d.endswith(f".{expected}") for d in diffs), diffs


@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.parametrize("pair", EXTRA_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_reshard_is_exact_everywhere(tmp_path, sources, pair):
    written = reshard_pairs(tmp_path, sources(pair[0]), [pair])
    assert_same_state(sources(pair[0])[pair[0]], written[pair])


@pytest.mark.slow
@pytest.mark.extra  # make test: test_resharded_pair_is_the_same_training (the same pair, judged by parity)
def test_resharded_run_trains_on_as_the_uninterrupted_one(tmp_path):
    """zero3@2 for 2 steps, resharded into ddp@1 for 2 more, against single for 4 straight: the
    first two losses are the source's own, bit for bit; the rest agree to 1e-5 (ZeRO's reduction
    order is not one process's, so the weights differ in the last bits)."""
    src, straight, resumed = tmp_path / "src", tmp_path / "straight", tmp_path / "resumed"
    run_cli(src, "strategy=zero3", "world_size=2", *COMMON, "trainer.steps=2", "trainer.checkpoint_every=2")
    run_cli(straight, "strategy=single", *COMMON, "trainer.steps=4")
    run_cli(
        resumed,
        "strategy=ddp",
        "world_size=1",
        *COMMON,
        "trainer.steps=4",
        f"trainer.resume={src / 'checkpoints' / checkpoint_name(2)}",
        "trainer.reshard=true",
    )
    first, whole, after = load_metrics(src), load_metrics(straight), load_metrics(resumed)
    assert after["losses"][:2] == first["losses"]
    assert after["resharded_from"]["strategy"] == "zero3" and after["resharded_from"]["world_size"] == 2
    assert_losses_close(after["losses"], whole["losses"], rtol=1e-5)


@pytest.fixture(scope="module")
def same_training():
    """The uninterrupted single run of SAVED_AT + CONTINUED steps and its noise floor."""
    return parity_reference("cnn", steps=SAVED_AT + CONTINUED, global_batch=32, data_size=96)


def continue_pairs(tmp_path: Path, source_paths: dict, pairs, broken: str = "") -> dict:
    """Each source continued CONTINUED steps under its target; returns {(source, target): metrics}."""
    runs = {}
    for world in sorted({TARGETS[t][0] for _, t in pairs}):
        batch = [(s, t) for s, t in pairs if TARGETS[t][0] == world]
        paths = []
        for s, t in batch:
            out = tmp_path / f"{_slug(s)}__{_slug(t)}"
            resume = (f"trainer.resume={source_paths[s]}", "trainer.reshard=true")
            paths.append(_config(out, world, TARGETS[t][1], f"trainer.steps={SAVED_AT + CONTINUED}", *resume))
            runs[(s, t)] = out
        run_ranks(train_resharded, world, timeout=TIMEOUT, config_paths=paths, broken=broken)
    return {pair: {**load_metrics(out), "run_dir": str(out)} for pair, out in runs.items()}


def judge_pairs(same_training, runs: dict) -> None:
    """Each continued run passes the parity criterion, each check's multiple of its envelope shown."""
    for (s, t), metrics in runs.items():
        assert metrics["resharded_from"]["step"] == SAVED_AT, metrics["resharded_from"]
        verdict = same_training.assert_run_matches(metrics, f"reshard {s}->{t}")
        print(f"{s} -> {t}:", ", ".join(f"{n} {c.ratio:.2g}x" for n, c in verdict.checks().items()))


@pytest.mark.floats  # parity verdicts against the unresharded run
@pytest.mark.slow
def test_resharded_pair_is_the_same_training(tmp_path, sources, same_training):
    """zero3@2 for 2 steps, resharded into ddp@1 for 2 more: parity with single for 4 straight;
    its first two losses are the source's own, bit for bit."""
    source = sources(*{s for s, _ in PARITY_DEFAULT})
    runs = continue_pairs(tmp_path, source, PARITY_DEFAULT)
    judge_pairs(same_training, runs)
    for (s, _), metrics in runs.items():
        assert metrics["losses"][:SAVED_AT] == load_metrics(source[s].parent.parent)["losses"]


@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.parametrize("pair", PARITY_EXTRA, ids=lambda p: f"{p[0]}->{p[1]}")
def test_resharded_runs_are_the_same_training(tmp_path, sources, same_training, pair):
    judge_pairs(same_training, continue_pairs(tmp_path, sources(pair[0]), [pair]))


@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.parametrize("broken", ["swap_moments", "step_not_restored"])
def test_parity_catches_a_broken_bridge(tmp_path, sources, same_training, broken):
    """The parity criterion fails the continued run when Adam's moments are swapped or its step
    counter restarts (bias correction of step 1 again: a step 10x too large)."""
    pair = PARITY_DEFAULT[0]
    metrics = continue_pairs(tmp_path, sources(pair[0]), [pair], broken=broken)[pair]
    params = load_final_params(Path(metrics["run_dir"]))
    verdict = same_training.verdict(metrics["losses"], params, f"reshard {broken}", expect_pass=False)
    print(broken, verdict.reason())
    assert not verdict.passed, verdict.reason()


# ----- python -m parallel_lab.checkpoint, and bad input (one line, exit 2, nothing written) -----
def _checkpoint_cmd(*args: str):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "parallel_lab", "checkpoint", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _deepspeed_own_merge(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The reference: every rank's ZeRO files read whole, merged by DeepSpeed's own zero_to_fp32
    functions (what the reader did before it streamed), for the master weights and each moment."""
    import re

    from deepspeed.utils import zero_to_fp32 as z

    from parallel_lab.checkpoint.deepspeed_state import _deepspeed_model_states
    from parallel_lab.checkpoint.ds_reader import weights_only_load

    def rank(f: Path) -> int:
        return int(re.search(r"rank_(\d+)", f.name)[1])

    shards = [
        weights_only_load(str(f), map_location="cpu")["optimizer_state_dict"]
        for f in sorted(folder.glob("*_optim_states.pt"), key=rank)
    ]
    stage, world = int(shards[0]["zero_stage"]), len(shards)
    states = _deepspeed_model_states(sorted(folder.glob("*model_states.pt"), key=rank))
    master, inner = (
        ("fp32_flat_groups", "optimizer_state_dict")
        if stage == 3
        else ("single_partition_of_fp32_groups", "base_optimizer_state")
    )
    groups = sorted(shards[0][inner]["state"])
    flats = {"param": [s[master] for s in shards]}
    flats.update({k: [[s[inner]["state"][g][k] for g in groups] for s in shards] for k in ("exp_avg", "exp_avg_sq")})
    merged = {}
    for key, flat in flats.items():
        if stage == 3:
            out = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat, states, False)
        else:
            out = z._get_fp32_state_dict_from_zero2_checkpoint(
                world, flat, states, False, shards[0].get("param_alignment_paddings")
            )
        merged[key] = {n: t.contiguous() for n, t in out.items()}
    return merged


def _assert_streamed_is_deepspeeds_merge(source: Path) -> None:
    full = consolidate(source)
    reference = _deepspeed_own_merge(source / "deepspeed")
    for name in full.param_names:
        assert torch.equal(full.model[name], reference["param"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(full.optim[name][key], reference[key][name]), f"{name}.{key}"


@pytest.mark.slow
def test_streamed_reader_is_deepspeeds_merge(sources):
    """The streaming ZeRO reader (one parameter at a time from mapped files, by DeepSpeed's layout
    rules) equals DeepSpeed's own merge of the whole partitions, bit for bit (stage 3 here; stages
    1 and 2 with their alignment paddings, and offload, under extra)."""
    _assert_streamed_is_deepspeeds_merge(sources("zero3@2")["zero3@2"])


@pytest.mark.extra
@pytest.mark.parametrize("name", ["zero2@2", "zero1_offload@2", "zero3_offload@2"])
def test_streamed_reader_is_deepspeeds_merge_every_stage(sources, name):
    _assert_streamed_is_deepspeeds_merge(sources(name)[name])


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}


@pytest.mark.slow
def test_reading_keeps_no_checkpoint_file_mapped(sources):
    """Streaming means a tensor handed out is a copy and no file stays mapped: otherwise every page
    ever touched would stay resident and reading a checkpoint would cost its whole size in RSS.
    Checked for each reader (ZeRO, replicated, tp shards) while a tensor is held and after."""
    for name, path in sources("zero3@2", "single@1", "tp@2").items():
        full = consolidate(path)
        held = [full.model[full.param_names[0]], full.optim[full.param_names[-1]]["exp_avg"]]
        files = {str(f.resolve()) for f in path.rglob("*.pt")}
        assert not files & _mapped_files(), f"{name}: a checkpoint file stays mapped while a tensor is held"
        for param in full.param_names:
            assert full.model[param].shape == full.model.shapes[param]
        assert not files & _mapped_files(), name
        del held


@pytest.mark.slow
def test_inspect_and_export(tmp_path, sources, capsys):
    """inspect names the writer and the bytes per rank (in process); export through
    `parallel-lab checkpoint` (a real process; the second export, to a file, through the same
    main() in process): its safetensors equal the full state."""
    from safetensors.torch import load_file

    from parallel_lab.checkpoint.__main__ import main as checkpoint_main

    src = sources("zero3@2")["zero3@2"]
    assert checkpoint_main(["inspect", str(src)]) == 0
    shown = capsys.readouterr().out
    assert "strategy=zero3 world_size=2 at step 2" in shown and "rank 1:" in shown
    done = _checkpoint_cmd("export", str(src), str(tmp_path / "out"), "--optimizer")
    assert done.returncode == 0, done.stderr
    full = consolidate(src)
    weights, adam = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(tmp_path / "out" / "optimizer.safetensors"),
    )
    assert all(torch.equal(weights[n], full.model[n]) for n in full.param_names)
    assert all(torch.equal(adam[f"{n}.exp_avg_sq"], full.optim[n]["exp_avg_sq"]) for n in full.param_names)
    # out ending in .safetensors: that file (its folder made), the optimizer state beside it, no folder
    target = tmp_path / "new" / "w.safetensors"
    assert checkpoint_main(["export", str(src), str(target), "--optimizer"]) == 0
    assert target.is_file() and sorted(p.name for p in target.parent.iterdir()) == [
        "w.optimizer.safetensors",
        "w.safetensors",
    ]
    weights, adam = load_file(target), load_file(tmp_path / "new" / "w.optimizer.safetensors")
    assert all(torch.equal(weights[n], full.model[n]) for n in full.param_names)
    assert all(torch.equal(adam[f"{n}.exp_avg"], full.optim[n]["exp_avg"]) for n in full.param_names)
    # trainer.init_from=w.safetensors finds the optimizer file beside it (checkpoint/outside.py)
    from parallel_lab.checkpoint.outside import read_outside
    from tests.support.cli import compose_cfg

    outside = read_outside(target, compose_cfg("model=cnn").model, with_optimizer=True)
    assert all(torch.equal(outside.optim[n]["exp_avg_sq"], full.optim[n]["exp_avg_sq"]) for n in full.param_names)
    again = _checkpoint_cmd("export", str(src), str(target))  # never overwrites
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1 and "w.safetensors" in again.stderr
    assert torch.equal(load_file(target)[full.param_names[0]], full.model[full.param_names[0]])


def test_export_help_says_what_out_is():
    """`export --help` tells a file from a folder and names the optimizer file (a real process)."""
    done = _checkpoint_cmd("export", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0 and "ending in .safetensors is the weights' file" in text
    assert "w.optimizer.safetensors" in text and "folder" in text


@pytest.mark.slow
def test_export_refuses_a_file_that_is_not_what_it_claims(tmp_path, sources, capsys):
    """A trainer file replaced by garbage (complete.json re-hashed, so only the reader can tell):
    one line, exit 2, nothing written; into a folder through a real process, into a file through
    the same main() in process (the reader refuses after torch is imported: ~4 s a process)."""
    import json
    import shutil

    from parallel_lab.checkpoint import COMPLETE, sha256_file
    from parallel_lab.checkpoint.__main__ import main as checkpoint_main

    src = tmp_path / "copy"
    shutil.copytree(sources("single@1")["single@1"], src)
    bad = src / "trainer_rank0.pt"
    bad.write_bytes(b"not a checkpoint at all")
    manifest = json.loads((src / COMPLETE).read_text())
    manifest["files"]["trainer_rank0.pt"] = {"size": bad.stat().st_size, "sha256": sha256_file(bad)}
    (src / COMPLETE).write_text(json.dumps(manifest))
    out = tmp_path / "out"
    result = _checkpoint_cmd("export", str(src), str(out))
    assert result.returncode == 2 and "trainer_rank0.pt" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
    out = tmp_path / "made" / "w.safetensors"
    code, stderr = checkpoint_main(["export", str(src), str(out)]), capsys.readouterr().err
    assert code == 2 and "trainer_rank0.pt" in stderr
    assert len(stderr.strip().splitlines()) == 1 and not out.exists()
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("trainer.reshard=true",), "trainer.reshard=true needs the checkpoint to re-cut"),
        (("trainer.reshard=true", "trainer.resume=never"), "trainer.resume=never names none"),
        (("strategy=zero1", "strategy.precision=bf16", "trainer.reshard=true", "trainer.resume=/x"), "precision=fp32"),
    ],
)
def test_bad_reshard_input_is_one_line(tmp_path, overrides, message):
    from parallel_lab.cli.run import run_cli as plain_run_cli

    result = plain_run_cli(tmp_path / "run", *overrides, *COMMON, "world_size=2", check=False, in_process=True)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_reshard_refuses_what_must_match(tmp_path, sources):
    """Another global batch is another training run: refused in one line before any process starts,
    and the target layout that cannot hold the model gets validate()'s own line."""
    src = sources("single@1")["single@1"]
    for overrides, message in [
        (("trainer.global_batch=64",), "global_batch=32 but this run has global_batch=64"),
        (("strategy=tp", "strategy.tp=3", "world_size=3"), "strategy.tp"),
    ]:
        result = run_cli(
            tmp_path / f"r{len(message)}",
            *COMMON,
            *overrides,
            f"trainer.resume={src}",
            "trainer.reshard=true",
            "trainer.steps=4",
            check=False,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
