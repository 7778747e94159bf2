"""The parent's does-it-fit check (parallel_lab/config/resources.py), in-process: the per-sample
activation figures the estimate uses, the refusal and its figures, no check without /proc, and the
CPU warning."""

from __future__ import annotations

import pytest

from parallel_lab.config import resources, validate
from parallel_lab.errors import ConfigError
from parallel_lab.models import MODELS
from tests.support.activations import saved_for_backward_bytes
from tests.support.cli import compose_cfg


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"gpt"}))
def test_activation_bytes_per_sample_match_a_real_forward(name):
    model = MODELS[name](num_classes=10)
    counted = saved_for_backward_bytes(model, batch=2) - saved_for_backward_bytes(model, batch=1)  # per sample
    assert MODELS[name].activation_bytes_per_sample == counted, f"set {name}'s figure to {counted}"


@pytest.mark.parametrize("sizes", [{}, {"layers": 3, "hidden": 128, "seq": 128, "heads": 8}])
def test_the_gpts_figure_is_a_formula_of_its_sizes_that_errs_high(sizes):
    """gpt has every size, so its figure is Korthikanti et al.'s formula (models/gpt.py), not a
    count: here it must stay above the real count (a guard that errs high: its 16-bit figures hold
    dropout masks this run has not), by under 60%."""
    model = MODELS["gpt"](**sizes)
    counted = saved_for_backward_bytes(model, batch=2) - saved_for_backward_bytes(model, batch=1)
    assert 1 < model.activation_bytes_per_sample / counted < 1.6


def test_run_that_cannot_fit_is_refused_with_its_figures(monkeypatch):
    per_rank = resources.estimate_rank_memory(validate(compose_cfg("strategy=ddp")), micro_batch=8)
    # The runtime part is the measured constant; the rest is cnn with 4096 synthetic images: see the
    # module's figures.
    assert per_rank.runtime == resources.WORKER_RUNTIME_BYTES
    assert 100 * 2**20 < per_rank.total - per_rank.runtime < 300 * 2**20
    # Room for 3.5 ranks.
    monkeypatch.setattr(resources, "memory_available_bytes", lambda: int(3.5 * per_rank.total))
    with pytest.raises(ConfigError, match=r"world_size=8 needs about 8 x \d+\.\d\d GiB = .* use world_size <= 3$"):
        validate(compose_cfg("strategy=ddp", "world_size=8"))
    validate(compose_cfg("strategy=ddp", "world_size=2"))  # fits: goes on


def test_estimate_grows_with_data_model_and_micro_batch():
    base = validate(compose_cfg("strategy=ddp"))
    small = resources.estimate_rank_memory(base, micro_batch=1)
    assert resources.estimate_rank_memory(base, micro_batch=32).activations > small.activations
    resnet = resources.estimate_rank_memory(validate(compose_cfg("strategy=ddp", "model=resnet18")), micro_batch=1)
    assert resnet.model_state == 11_173_962 * 16  # weights, gradients and Adam's two moments, fp32
    more_data = resources.estimate_rank_memory(validate(compose_cfg("strategy=ddp", "data.size=8192")), micro_batch=1)
    assert more_data.data > small.data


def test_one_rank_that_cannot_fit_asks_for_a_smaller_run(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1024 kB\nMemAvailable:    512 kB\n")
    monkeypatch.setattr(resources, "MEMINFO", meminfo)
    with pytest.raises(ConfigError, match=r"world_size=1 .* 0\.0 GiB available; free memory, or lower data.size"):
        validate(compose_cfg("strategy=single"))


def test_no_meminfo_means_no_memory_check(monkeypatch, tmp_path):
    monkeypatch.setattr(resources, "MEMINFO", tmp_path / "missing")
    monkeypatch.setattr(resources, "cpu_cores", lambda: 64)
    validate(compose_cfg("strategy=ddp", "world_size=64", "data.size=200000"))  # would need hundreds of GiB


def test_more_threads_than_cores_warns_once_and_goes_on(monkeypatch, capsys):
    monkeypatch.setattr(resources, "cpu_cores", lambda: 2)
    validate(compose_cfg("strategy=ddp", "world_size=4", "trainer.global_batch=40"))  # 2 threads a core: fine
    assert capsys.readouterr().err == ""
    validate(compose_cfg("strategy=ddp", "world_size=5", "trainer.global_batch=40"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("parallel_lab: warning: world_size=5 x trainer.threads=1 = 5")
    assert "<= 2" in lines[0]


def test_pinning_more_threads_than_cores_is_refused(monkeypatch):
    monkeypatch.setattr(resources, "cpu_cores", lambda: 2)
    validate(compose_cfg("strategy=ddp", "world_size=2", "trainer.pin_cores=true"))  # a core each: fine
    validate(compose_cfg("strategy=ddp", "world_size=3", "trainer.global_batch=66"))  # unpinned: a warning at most
    with pytest.raises(
        ConfigError,
        match=r"^trainer\.pin_cores=true needs 3 ranks per host x trainer\.threads=1 = 3 cores, this machine "
        r"allows 2; use trainer\.pin_cores=false, or at most 2 ranks per host$",
    ):
        validate(compose_cfg("strategy=ddp", "world_size=3", "trainer.global_batch=66", "trainer.pin_cores=true"))
