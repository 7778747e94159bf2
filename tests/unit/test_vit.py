"""model=vit in-process: its layout, the same weights for the same seed, the attention against
torch's own, the config's one-line refusals, its FLOPs against the hand formula, and the planner's
count of saved activations against what autograd saves in a real forward (whole model, a
data-parallel rank's micro-batch and each pipeline stage), and trainer.recompute (the same
training bit for bit, the forward's dropout masks on recompute, the planned bytes per mode).
Training under the strategies: tests/integration/test_vit.py and test_recompute.py."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.errors import ConfigError
from parallel_lab.models import build_meta_model, build_model, validate_model_config
from parallel_lab.models.flops import layer_flops
from parallel_lab.models.recompute import MODES as RECOMPUTE_MODES
from parallel_lab.models.recompute import set_recompute, setting_of
from parallel_lab.models.vit import DEFAULTS, AttentionCore, ViT
from tests.support.activations import saved_by_forward, saved_for_backward_bytes
from tests.support.cli import ROOT, assert_one_clean_line, compose_cfg, run_cli


def vit_cfg(**sizes):
    return OmegaConf.create({"name": "vit", "num_classes": 10, **sizes})


def test_layout_is_coarse_blocks_with_named_split_points():
    model = build_meta_model(vit_cfg(depth=3))
    assert [n for n, _ in model.named_children()] == ["embed", "block0", "block1", "block2", "head"]
    names = {n for n, _ in model.named_modules()}
    for layer in ("attn.q", "attn.k", "attn.v", "attn.proj", "attn.core", "mlp.fc1", "mlp.fc2", "norm1", "norm2"):
        assert f"block1.{layer}" in names
    assert model.block0.mlp.fc1.out_features == 2 * 64 and model.block0.attn.q.out_features == 64


def test_same_seed_same_weights_and_logits_of_the_right_shape():
    a, b, c = (build_model(vit_cfg(), seed) for seed in (0, 0, 1))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.embed.pos, c.embed.pos)
    x = torch.randn(5, 3, 32, 32)
    assert a(x).shape == (5, 10) and torch.equal(a(x), b(x))


def test_attention_core_equals_torch_scaled_dot_product_attention():
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(AttentionCore(8)(q, k, v), expected)


def test_cnn_and_resnet18_are_unchanged_by_the_vit_keys():
    """The composed config now carries the vit's keys (null); cnn and resnet18 build as before."""
    from parallel_lab.models import MODELS

    for name in ("cnn", "resnet18"):
        composed = build_model(compose_cfg(f"model={name}").model, seed=3)
        torch.manual_seed(3)
        plain = MODELS[name](num_classes=10)
        for pa, pb in zip(composed.parameters(), plain.parameters(), strict=True):
            assert torch.equal(pa, pb)


def test_vit_yaml_writes_out_the_models_defaults():
    written = OmegaConf.load(ROOT / "conf/model/vit.yaml")
    assert {k: written[k] for k in DEFAULTS} == DEFAULTS
    assert compose_cfg("model=vit").model.dim == DEFAULTS["dim"]


BAD = {
    "heads-not-dividing-dim": ({"dim": 64, "heads": 5}, "model.heads=5 does not divide model.dim=64"),
    "patch-not-dividing-32": ({"patch": 5}, "model.patch=5 does not divide"),
    "depth-0": ({"depth": 0}, "model.depth=0 must be an integer >= 1"),
    "dropout-1": ({"dropout": 1.0}, "model.dropout=1.0 must be in [0, 1)"),
    "dropout-negative": ({"dropout": -0.1}, "model.dropout=-0.1 must be in [0, 1)"),
    "mlp-ratio-0": ({"mlp_ratio": 0.0}, "model.mlp_ratio=0.0 gives no MLP width"),
    "batchnorm": ({"norm": "batch"}, "model.norm=batch: the vit has LayerNorm, no BatchNorm"),
    "dropout-placement": ({"dropout_placement": "bert"}, "model.dropout_placement=bert is unknown"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sizes_are_one_line_refusals(case):
    sizes, message = BAD[case]
    with pytest.raises(ConfigError, match=r"^[^\n]*; use [^\n]*$") as err:
        validate_model_config(vit_cfg(**sizes))
    assert message in str(err.value)


def test_the_command_line_refuses_a_bad_vit_with_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, "model=vit", "model.heads=3", check=False, timeout=120)
    assert_one_clean_line(result, run_dir, "model.heads=3 does not divide model.dim=64")
    assert result.returncode == 2 and not run_dir.exists()


def test_flops_equal_the_hand_formula():
    batch, patch, dim, depth, heads, ratio = 3, 4, 32, 2, 2, 2.0
    tokens, hidden = (32 // patch) ** 2, int(dim * ratio)
    flops = layer_flops(build_meta_model(vit_cfg(patch=patch, dim=dim, depth=depth, heads=heads)), batch)
    embed = 2 * batch * tokens * dim * (3 * patch * patch)  # one patch x patch x 3 dot product per token and channel
    linears = 2 * batch * tokens * (4 * dim * dim + 2 * dim * hidden)  # q, k, v, proj; fc1, fc2
    attention = 2 * 2 * batch * heads * tokens * tokens * (dim // heads)  # q k^T and probs v
    head = 2 * batch * dim * 10
    assert sum(flops.values()) == embed + depth * (linears + attention) + head
    assert flops["block1.attn.core"] == attention


@pytest.mark.parametrize("sizes", [{}, {"dropout": 0.1, "depth": 2}, {"patch": 8, "heads": 2, "width": 0.5}])
def test_saved_activations_counted_on_meta_equal_a_real_forward(sizes):
    """The count every strategy's plan uses, at the vit's default and other sizes, dropout's masks included."""
    from parallel_lab.plan.predict import saved_activation_bytes

    cfg = vit_cfg(**sizes)
    assert saved_activation_bytes(build_meta_model(cfg), 3) == saved_for_backward_bytes(build_model(cfg, 0), 3)


@pytest.mark.parametrize(
    "strategy, recompute", [("fsdp", "none"), ("zero3", "none"), ("pp", "none"), ("zero3", "full"), ("pp", "selective")]
)
def test_planned_activations_of_every_rank_equal_a_real_forward_of_its_part(strategy, recompute):
    """plan_world at world 2: a sharded rank's micro-batch through the whole model, a pipeline
    stage's micro-batches through its own blocks (the stage cut as pp cuts it), counted for real
    (with trainer.recompute: through torch's checkpoint, which keeps its regions' inputs)."""
    from parallel_lab.config import validate
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from parallel_lab.strategies.pp.plan import plan_stages

    overrides = ("model=vit", f"strategy={strategy}", "world_size=2", "trainer.global_batch=8")
    cfg = validate(compose_cfg(*overrides, f"trainer.recompute={recompute}"))
    meta, real = build_meta_model(cfg.model), build_model(cfg.model, 0)
    set_recompute(real, recompute)
    plans = plan_world(cfg, get_strategy_class(strategy), meta)
    assert {p.recompute for p in plans} == {recompute} and (plans[0].recompute_bytes > 0) == (recompute != "none")
    if strategy != "pp":
        assert [p.activation_bytes for p in plans] == [saved_for_backward_bytes(real, 4)] * 2
        return
    m, stages = cfg.strategy.microbatches, plan_stages(meta, 2, [])
    stash = [m, m] if cfg.strategy.schedule == "gpipe" else [min(m, 2), min(m, 1)]
    first, last = (torch.nn.Sequential(OrderedDict((n, real.get_submodule(n)) for n in names)) for names in stages)
    x = torch.zeros(8 // m, 3, 32, 32)
    sent = first(x).detach().requires_grad_()  # what stage 1 receives
    assert plans[0].activation_bytes == stash[0] * saved_by_forward(first, x, loss=False)
    assert plans[1].activation_bytes == stash[1] * saved_by_forward(last, sent, loss=True)


# ----- dropout: a sample's mask does not depend on the batch it is in (models/dropout.py) -----
def test_dropout_masks_are_the_same_however_the_batch_is_split():
    cfg, x = vit_cfg(dropout=0.2), torch.randn(8, 3, 32, 32)
    whole, split = build_model(cfg, 0), build_model(cfg, 0)
    expected = whole(x)
    torch.testing.assert_close(torch.cat([split(x[:3]), split(x[3:5]), split(x[5:])]), expected, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    other_seed = ViT(dropout=0.2, seed=1)  # whole's weights, masks keyed by another seed
    assert not torch.allclose(other_seed(x), expected, atol=1e-3)
    assert not torch.allclose(whole(x), expected, atol=1e-3)  # a sample's next occurrence: a new mask


def test_dropout_is_off_in_eval_and_draws_nothing_at_zero():
    x = torch.randn(4, 3, 32, 32)
    dropped, plain = build_model(vit_cfg(dropout=0.5), 0), build_model(vit_cfg(), 0)
    assert not torch.allclose(dropped(x), plain(x), atol=1e-3)
    assert torch.equal(dropped.eval()(x), plain.eval()(x))  # the same weights: dropout draws no init numbers
    before = torch.random.get_rng_state()
    plain.train()(x)
    assert torch.equal(torch.random.get_rng_state(), before)


# ----- trainer.recompute (models/recompute.py) -----
MODES = ("none", "selective", "full")


def _trained(mode: str, dropout: float, steps: int = 2) -> tuple[list[float], torch.nn.Module]:
    """Adam steps of the vit at batch 4 with this recompute mode: (losses, the model)."""
    model = build_model(vit_cfg(dropout=dropout, depth=2), 0)
    set_recompute(model, mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 3, 32, 32, generator=data), torch.randint(0, 10, (4,), generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.floats
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recompute_trains_bit_for_bit_as_none_at_world_1(dropout):
    """The same losses and weights, to the bit, with the same parameter names (state_dict keys)."""
    losses, base = _trained("none", dropout)
    for mode in ("selective", "full"):
        ours, model = _trained(mode, dropout)
        assert ours == losses, (mode, ours, losses)
        assert list(model.state_dict()) == list(base.state_dict())
        for (name, a), b in zip(model.state_dict().items(), base.state_dict().values(), strict=True):
            assert torch.equal(a, b), (mode, name)


def test_each_mode_recomputes_its_regions_in_backward():
    """full: each block's computation runs again in backward; selective: only each attention core."""
    model = build_model(vit_cfg(depth=2), 0)
    calls: dict[str, int] = {}

    def counted(name: str, function):
        def run(*args):
            calls[name] = calls.get(name, 0) + 1
            return function(*args)

        return run

    model.block0.compute = counted("block", model.block0.compute)
    model.block0.attn.core.attend = counted("core", model.block0.attn.core.attend)
    # A pre-hook: torch stops a recomputation once the last saved tensor is back, inside fc2's call.
    model.block0.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls.get("mlp", 0) + 1))
    expected = {"none": (1, 1, 1), "selective": (1, 2, 1), "full": (2, 2, 2)}
    for mode, counts in expected.items():
        set_recompute(model, mode)
        calls.clear()
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        assert (calls["block"], calls["core"], calls["mlp"]) == counts, mode
    with torch.no_grad():  # nothing saved, nothing to recompute
        calls.clear()
        model(torch.randn(2, 3, 32, 32))
        assert (calls["block"], calls["core"], calls["mlp"]) == (1, 1, 1)
    assert setting_of(build_model(vit_cfg(), 0)).mode == "none"  # the default
    with pytest.raises(ValueError, match="recompute=full"):
        set_recompute(build_model(OmegaConf.create({"name": "cnn", "num_classes": 10}), 0), "full")


@pytest.mark.floats
def test_recompute_draws_the_forwards_masks_when_other_forwards_ran_in_between(mode="full"):
    """A pipeline's 1F1B runs micro-batch 2's forward before micro-batch 1's backward: the recomputed
    region must draw micro-batch 1's masks (models/dropout.py keys them by the batch in flight).
    full: every dropout site of the blocks, the attention core's (selective's region) among them."""
    grads = {}
    for m in ("none", mode):
        model = build_model(vit_cfg(dropout=0.3, depth=2), 0)
        set_recompute(model, m)
        data = torch.Generator().manual_seed(2)
        first, second = (model(torch.randn(3, 3, 32, 32, generator=data)).square().sum() for _ in range(2))
        first.backward()
        second.backward()
        grads[m] = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[mode], strict=True))


def test_the_configs_recompute_choices_are_the_models_modes():
    from parallel_lab.config.schema import Recompute

    assert tuple(m.value for m in Recompute) == MODES == RECOMPUTE_MODES


def _region_saved(function, *inputs: torch.Tensor) -> int:
    """Bytes a region saves in a plain forward, its inputs left out (they are kept anyway): what
    its recomputation saves again in backward, counted on real CPU tensors."""
    inputs = tuple(t.detach().requires_grad_() for t in inputs)
    kept = {t.untyped_storage().data_ptr() for t in inputs}
    params = {p.untyped_storage().data_ptr() for p in getattr(function, "__self__").parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in kept:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        function(*inputs)
    return sum(saved.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", MODES)
def test_planned_bytes_per_mode_equal_a_real_recomputing_forward(mode, dropout):
    """Saved: what autograd keeps through a real forward with torch's checkpoint (its regions'
    inputs and everything outside them). Recomputed: the largest region's own saves, measured in
    a real plain forward of that region (block, or attention core on the block's real q, k, v)."""
    from parallel_lab.plan.predict import recompute_peak_bytes, saved_activation_bytes

    cfg, batch = vit_cfg(dropout=dropout, depth=2), 3
    real, meta = build_model(cfg, 0), build_meta_model(cfg)
    set_recompute(real, mode)
    assert saved_activation_bytes(meta, batch, recompute=mode) == saved_for_backward_bytes(real, batch)
    block, x = real.block1, real.embed(torch.randn(batch, 3, 32, 32))
    if mode == "full":
        measured = _region_saved(block.compute, x)
    elif mode == "selective":
        attn, h = block.attn, block.norm1(x)
        qkv = [f(h).view(batch, h.shape[1], attn.heads, -1).transpose(1, 2) for f in (attn.q, attn.k, attn.v)]
        measured = _region_saved(attn.core.attend, *qkv)
    else:
        measured = 0
    assert recompute_peak_bytes(meta, batch, recompute=mode) == measured
    if mode != "none":  # what recomputation is for
        assert saved_activation_bytes(meta, batch, recompute=mode) < saved_activation_bytes(meta, batch)
