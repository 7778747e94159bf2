"""The MoE MLP in one process (models/moe.py): the layer against a token-by-token reference, the
routing's independence of how the batch is split (what makes data and expert parallelism train as
single does), the capacity's drops, the load-balancing loss by its formula and in the training
loss, the meta-device forward and the config's one-line refusals; the same layer in the gpt's
blocks (models/gpt.py). Expert parallelism on real
ranks: tests/integration/test_ep.py."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.errors import ConfigError
from parallel_lab.models import build_meta_model, build_model, training_loss, validate_model_config
from parallel_lab.models.flops import layer_flops
from parallel_lab.models.moe import AuxLosses, MoEMLP, capacity, moe_layers

E, K, DIM, HIDDEN = 4, 2, 8, 16


def layer(capacity_factor=None, topk=K) -> MoEMLP:
    torch.manual_seed(0)
    return MoEMLP(DIM, HIDDEN, E, topk, capacity_factor, 0.01, 0, AuxLosses()).double()


def token_by_token(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its top-k experts' outputs, weighted by the renormalised probabilities."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            probs = moe.router(x[b, s]).softmax(-1)
            top_p, top_e = probs.topk(moe.topk)
            gates = top_p / top_p.sum() if moe.topk > 1 else top_p
            out[b, s] = sum(g * moe.experts[e](x[b, s]) for g, e in zip(gates, top_e.tolist()))
    return out


def switch_aux(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Switch's E * sum_e f_e P_e per sample (f_e: first choices, P_e: mean probability), averaged."""
    per_sample = []
    for sample in x:
        probs = moe.router(sample).softmax(-1)
        f = torch.stack([(probs.argmax(-1) == e).double().mean() for e in range(E)])
        per_sample.append(E * (f * probs.mean(0)).sum())
    return torch.stack(per_sample).mean()


@pytest.mark.parametrize("topk", [1, 2])
def test_dropless_layer_equals_each_token_routed_alone(topk):
    moe, x = layer(topk=topk), torch.randn(3, 5, DIM, dtype=torch.float64)
    torch.testing.assert_close(moe(x), token_by_token(moe, x))
    torch.testing.assert_close(moe.aux.total(), 0.01 * switch_aux(moe, x))


def test_routing_depends_on_the_sample_alone_so_any_batch_split_computes_the_same():
    """Each half of the batch gives its rows of the whole batch's output, and the mean of the halves'
    losses is the whole's, also with a capacity that drops copies: routing groups are samples."""
    for cf in (None, 0.5):
        moe, x = layer(cf), torch.randn(4, 6, DIM, dtype=torch.float64)
        whole, aux = moe(x), moe.aux.total()
        halves = [(moe(part), moe.aux.total()) for part in x.chunk(2)]
        torch.testing.assert_close(torch.cat([h for h, _ in halves]), whole)
        torch.testing.assert_close(sum(a for _, a in halves) / 2, aux)


def test_capacity_keeps_first_choices_first_and_at_most_c_copies_per_expert():
    moe, x = layer(capacity_factor=0.5), torch.randn(2, 8, DIM, dtype=torch.float64)
    cap = capacity(0.5, K, 8, E)
    assert cap == 2
    r = moe.route(x)
    kept = torch.zeros(2, E, dtype=torch.long)
    for t, e in zip(r.token.tolist(), r.expert.tolist()):
        kept[t // 8, e] += 1
    assert kept.max() <= cap and len(r.token) < 2 * 8 * K  # some copies dropped, none over capacity
    # GShard's priority: an expert takes every first choice (up to C) before any second choice
    probs = moe.router(x).softmax(-1)
    first = probs.argmax(-1)
    for b in range(2):
        for e in range(E):
            firsts = int((first[b] == e).sum())
            kept_first = sum(
                1
                for t, ex in zip(r.token.tolist(), r.expert.tolist())
                if t // 8 == b and ex == e and int(first.view(-1)[t]) == e
            )
            assert kept_first == min(firsts, cap)
    dropless = layer().route(x)
    assert dropless.counts.sum() == 2 * 8 * K


def test_the_training_loss_adds_the_load_balancing_loss_and_trains_the_router_by_it():
    cfg = OmegaConf.create({"name": "vit", "num_classes": 10, "patch": 16, "depth": 2, "moe_experts": E, "moe_topk": K})
    model = build_model(cfg, seed=0)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    loss = training_loss(model)(model(x), y)
    ce = torch.nn.functional.cross_entropy(model(x), y)
    assert [m.layer for m in moe_layers(model)] == [1] and float(model.aux.total().detach()) > 0
    torch.testing.assert_close(loss, ce + model.aux.total())
    # with the classifier's loss held fixed, the router still gets a gradient: from the aux loss
    model.zero_grad()
    model(x)
    model.aux.total().backward()
    assert model.block1.mlp.router.weight.grad.abs().sum() > 0
    dense = build_model(OmegaConf.create({"name": "vit", "num_classes": 10, "patch": 16, "depth": 2}), seed=0)
    assert isinstance(training_loss(dense), torch.nn.CrossEntropyLoss)  # no MoE: the loss as before


def test_meta_forward_counts_each_expert_an_equal_share_of_the_copies():
    cfg = OmegaConf.create({"name": "vit", "num_classes": 10, "patch": 8, "depth": 2, "moe_experts": E, "moe_topk": K})
    flops = layer_flops(build_meta_model(cfg), batch=4)
    rows = 4 * 16 * K / E  # 16 tokens per sample at patch 8
    assert flops["block1.mlp.experts.3.fc1"] == 2 * rows * 64 * 128
    assert "block0.mlp.fc1" in flops  # block 0 stays dense (moe_every=2)


@pytest.mark.parametrize("model", ["vit", "gpt"])
def test_planned_activations_of_the_moe_model_are_a_real_forwards(model):
    """The planner's meta forward (each expert an equal share of the copies) saves what a real
    forward saves, routing and all: without expert parallelism a dropless layer's experts together
    take every copy however the router splits them (the sort's gather of the gates included)."""
    from parallel_lab.models import input_shape
    from parallel_lab.plan.predict import saved_activation_bytes
    from tests.support.activations import saved_for_backward_bytes

    sizes = {"vit": {"patch": 8, "depth": 2}, "gpt": {"layers": 2, "hidden": 32, "heads": 4, "seq": 32, "vocab": 64}}
    cfg = OmegaConf.create({"name": model, "num_classes": 10, **sizes[model], "moe_experts": E, "moe_topk": K})
    real = build_model(cfg, 0).train()
    for batch in (3, 8):
        planned = saved_activation_bytes(build_meta_model(cfg), batch, input_shape(real))
        assert planned == saved_for_backward_bytes(real, batch), (model, batch)


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"moe_experts": 4, "moe_topk": 5}, "model.moe_topk=5"),
        ({"moe_experts": 4, "moe_every": 9}, "model.moe_every=9"),
        ({"moe_experts": 4, "moe_capacity_factor": -1.0}, "model.moe_capacity_factor=-1.0"),
        ({"moe_experts": 4, "dropout": 0.1}, "model.dropout=0.1"),
        ({"moe_experts": 4, "name": "cnn"}, "model.moe_experts=4"),
    ],
)
def test_bad_moe_keys_are_refused_naming_the_value(keys, named):
    cfg = OmegaConf.create({"name": "vit", "num_classes": 10, **keys})
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate_model_config(cfg)


def test_capacity_formula():
    assert capacity(1.0, 2, 64, 4) == 32 and capacity(1.25, 1, 10, 4) == math.ceil(1.25 * 10 / 4)


GPT_MOE = {"name": "gpt", "layers": 4, "hidden": 16, "heads": 2, "seq": 8, "vocab": 32, "moe_experts": E, "moe_topk": K}


def test_the_gpt_has_moe_mlps_in_every_moe_every_th_block_and_adds_their_aux_loss():
    """Blocks 1 and 3 of 4 (moe_every=2) hold E experts of the dense MLP's shape (hidden -> ffn ->
    hidden) and a router; the training loss is the token cross-entropy plus both layers' weighted
    load-balancing losses, each Switch's formula on the block's input."""
    model = build_model(OmegaConf.create(GPT_MOE), seed=0)
    assert [m.layer for m in moe_layers(model)] == [1, 3]
    assert [type(getattr(model, f"block{i}").mlp).__name__ for i in range(4)] == ["MLP", "MoEMLP"] * 2
    assert model.block1.mlp.experts[0].fc1.weight.shape == (64, 16) and model.block1.mlp.router.out_features == E
    ids = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    inputs = {}
    for i in (1, 3):
        mlp = getattr(model, f"block{i}").mlp
        mlp.register_forward_hook(lambda m, args, _out, i=i: inputs.__setitem__(i, args[0].detach()))
    logits = model(ids)
    loss = training_loss(model)(logits, ids)
    with torch.no_grad():
        expected = sum(0.01 * switch_aux(getattr(model, f"block{i}").mlp, inputs[i]) for i in (1, 3))
    torch.testing.assert_close(model.aux.total().detach(), expected.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, ids) + model.aux.total())


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"mlp": "swiglu"}, "model.mlp=swiglu"),
        ({"moe_every": 5}, "model.layers=4"),
        ({"dropout": 0.1}, "model.dropout=0.1"),
    ],
)
def test_bad_gpt_moe_keys_are_refused_naming_the_value(keys, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate_model_config(OmegaConf.create({**GPT_MOE, **keys}))


def test_tp_on_the_moe_gpt_is_refused_in_one_line():
    """The gpt's tp loss (vocab-parallel cross-entropy) would drop the load-balancing loss."""
    from tests.support.model_parallel import assert_one_line_config_error

    overrides = ["model=gpt", "data=tokens", "world_size=2", f"model.moe_experts={E}", f"model.moe_topk={K}"]
    assert_one_line_config_error("tp", overrides, [f"model.moe_experts={E}", "strategy=tp", "load-balancing loss"])
