"""model=gpt in-process: every preset built on the meta device with the parameter count of its
published shape (the formula computed here, independently of the module), the causal grouped-query
attention against torch's own, causality itself, tied embeddings as one parameter, the planner's
census of the real module's operators against the hand FLOPs formula, and the config's one-line
refusals. Training under the strategies: tests/integration/test_gpt.py."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.errors import ConfigError
from parallel_lab.models import build_model, count_params, validate_model_config
from parallel_lab.models.gpt import PRESETS, CausalCore, build_gpt

# Published sizes, in billions: Narayanan et al. 2021 Table 1's "Number of parameters (billion)",
# Korthikanti et al. 2022 Table 3's names, GPT-3's 175B, Llama 3's 8B/70B/405B, the generic names.
PUBLISHED_B = {
    "gpt3_175b": 175,
    "narayanan_1.7b": 1.7,
    "narayanan_3.6b": 3.6,
    "narayanan_7.5b": 7.5,
    "narayanan_18b": 18.4,
    "narayanan_39b": 39.1,
    "narayanan_76b": 76.1,
    "narayanan_145b": 145.6,
    "narayanan_310b": 310.1,
    "narayanan_530b": 529.6,
    "narayanan_1t": 1008.0,
    "korthikanti_22b": 22,
    "korthikanti_175b": 175,
    "korthikanti_530b": 530,
    "korthikanti_1t": 1000,
    "llama3_8b": 8,
    "llama3_70b": 70,
    "llama3_405b": 405,
    "generic_1.3b": 1.3,
    "generic_7b": 6.74,  # Llama 2's released counts
    "generic_13b": 13.0,
    "generic_70b": 69.0,
}


def shape_formula(p: dict) -> int:
    """Parameters of a pre-LN decoder from its shape alone: per layer the attention (q and output
    h x h, k and v h x kv_heads*head_dim), the MLP (2 or, gated, 3 h x ffn matrices), two
    LayerNorms (2h each) and the biases; then the token embedding, learned positions, the final
    LayerNorm and, untied, the output projection. For GPT-3's shape this is 12 L h^2 + 13 L h + V h + S h + 2h."""
    h, layers, ffn = p["hidden"], p["layers"], p["ffn"]
    kv = p["kv_heads"] * (h // p["heads"])
    mats = 2 * h * h + 2 * h * kv + (3 if p["mlp"] == "swiglu" else 2) * h * ffn
    biases = (2 * h + 2 * kv + (2 if p["mlp"] == "swiglu" else 1) * ffn + h) if p["bias"] else 0
    per_layer = mats + biases + 4 * h
    embeddings = p["vocab"] * h * (1 if p["tied"] else 2) + (p["seq"] * h if p["positions"] == "learned" else 0)
    return layers * per_layer + embeddings + 2 * h


def test_every_preset_builds_on_meta_with_its_published_parameter_count():
    """Each preset at 1 and 2 layers (the count is linear in the layers, so these two give the
    whole model's), and three of them whole: the formula's count, and within 3% of the paper's."""
    assert set(PRESETS) == set(PUBLISHED_B)
    for name, row in PRESETS.items():
        one, two = (count_params(build_gpt({"preset": name, "layers": n})) for n in (1, 2))
        assert (one, two) == (shape_formula({**row, "layers": 1}), shape_formula({**row, "layers": 2})), name
        whole = one + (row["layers"] - 1) * (two - one)
        # Within 3% of the paper's figure (Narayanan's "1.7B" is 1.65B by its own shape).
        assert abs(whole / (PUBLISHED_B[name] * 1e9) - 1) < 0.03, name
    for name in ("gpt3_175b", "llama3_405b", "narayanan_1t"):
        model = build_gpt({"preset": name})  # meta: no memory
        assert all(p.is_meta for p in model.parameters())
        assert count_params(model) == shape_formula(PRESETS[name]), name
    gpt3 = PRESETS["gpt3_175b"]
    h, layers = gpt3["hidden"], gpt3["layers"]
    assert shape_formula(gpt3) == 12 * layers * h * h + 13 * layers * h + (gpt3["vocab"] + gpt3["seq"]) * h + 2 * h


def test_explicit_sizes_override_the_preset_and_the_build_is_seeded():
    small = build_gpt({"preset": "llama3_8b", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96})
    assert count_params(small) == shape_formula({**PRESETS["llama3_8b"], "layers": 2, "hidden": 64, "heads": 4,
                                                 "kv_heads": 2, "ffn": 96})  # fmt: skip
    a, b = (build_gpt({"layers": 1, "hidden": 32}, device="cpu", seed=7) for _ in range(2))
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.floats
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_causal_core_equals_torch_causal_attention_with_grouped_kv(kv_heads):
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 16, 8, dtype=torch.float64) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(CausalCore(8)(q, k, v), expected)


@pytest.mark.floats
@pytest.mark.parametrize("sizes", [{}, {"positions": "rotary", "kv_heads": 2, "mlp": "swiglu", "tied": False}])
def test_a_token_sees_only_its_past_and_logits_are_batch_vocab_seq(sizes):
    model = build_gpt({"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, **sizes}, device="cpu")
    x = torch.randint(0, 64, (2, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64
    out, out2 = model(x), model(changed)
    assert out.shape == (2, 64, 16)
    torch.testing.assert_close(out[..., :10], out2[..., :10])
    assert not torch.allclose(out[..., 10:], out2[..., 10:])


def test_tied_embeddings_are_one_parameter_and_one_state_dict_key():
    tied = build_gpt({"layers": 1, "hidden": 32, "vocab": 64}, device="cpu")
    untied = build_gpt({"layers": 1, "hidden": 32, "vocab": 64, "tied": False}, device="cpu")
    assert "head.out.weight" not in tied.state_dict() and "head.out.weight" in untied.state_dict()
    assert count_params(untied) - count_params(tied) == 64 * 32
    tied(torch.randint(0, 64, (2, 8))).sum().backward()
    assert tied.embed.tokens.weight.grad is not None and tied.head.weight() is tied.embed.tokens.weight


def test_the_census_counts_the_real_modules_matmul_flops():
    """plan/census.py on a meta gpt: forward + backward matmul FLOPs = 3 x the forward's, each
    Linear 2 x tokens x in x out, attention's two seq x seq products, the head's h x vocab."""
    from parallel_lab.plan.census import count_pass

    s = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "seq": 16, "vocab": 64, "ffn": 48}
    batch, h, seq = 3, s["hidden"], s["seq"]
    kv = s["kv_heads"] * h // s["heads"]
    linears = 2 * h * h + 2 * h * kv + 2 * h * s["ffn"]
    attention = 2 * 2 * s["heads"] * seq * seq * (h // s["heads"])
    forward = 2 * batch * seq * (s["layers"] * linears + h * s["vocab"]) + batch * s["layers"] * attention
    assert count_pass(build_gpt(s), batch).units["matmul"] == 3 * forward


@pytest.mark.parametrize(
    "sizes, message",
    [
        ({"preset": "gpt5"}, "model.preset=gpt5 is unknown"),
        ({"heads": 3}, "model.heads=3 must divide model.hidden=64"),
        ({"kv_heads": 3}, "model.kv_heads=3 must divide model.heads=4"),
        ({"positions": "alibi"}, "model.positions=alibi is unknown"),
        ({"mlp": "relu"}, "model.mlp=relu is unknown"),
        ({"width": 2.0}, "drop model.norm and model.width"),
    ],
)
def test_bad_sizes_are_refused_in_one_line(sizes, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_model_config(OmegaConf.create({"name": "gpt", "num_classes": 10, **sizes}))


def test_build_model_takes_the_same_config():
    model = build_model(OmegaConf.create({"name": "gpt", "num_classes": 10, "layers": 1, "hidden": 32}), seed=0)
    assert model.input_shape == (64,) and len(model) == 3


@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("ddp", ("model.dropout=0.1", "model.positions=rotary", "model.kv_heads=2")),
        ("fsdp", ("trainer.recompute=selective", "model.tied=false", "model.mlp=swiglu")),
        ("zero3", ("trainer.recompute=full",)),
    ],
)
def test_planned_activations_equal_a_real_forward(strategy, extra):
    """plan_world's activation bytes at world 2 (micro-batch 4) against what autograd saves in a real
    forward and loss of the same model (with trainer.recompute: through torch's checkpoint)."""
    from parallel_lab.config import validate
    from parallel_lab.models import build_meta_model
    from parallel_lab.models.recompute import set_recompute
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from tests.support.activations import saved_for_backward_bytes
    from tests.support.cli import compose_cfg
    from tests.support.reference import GPT_RUN

    cfg = validate(compose_cfg(*GPT_RUN, f"strategy={strategy}", "world_size=2", "trainer.global_batch=8", *extra))
    real = build_model(cfg.model, 0)
    set_recompute(real, cfg.trainer.recompute)
    plans = plan_world(cfg, get_strategy_class(strategy), build_meta_model(cfg.model))
    assert [p.activation_bytes for p in plans] == [saved_for_backward_bytes(real, 4)] * 2


# ----- data=tokens: the synthetic chain, a text file's bytes, and what the parent refuses -----
def test_token_data_labels_are_the_next_token_and_the_chain_is_learnable(tmp_path):
    from parallel_lab.data import load_datasets
    from parallel_lab.data.tokens import SUCCESSORS

    cfg = OmegaConf.create({"name": "tokens", "size": 64, "seq": 16, "vocab": 32, "path": None})
    (train, held), (again, _) = load_datasets(cfg, 3), load_datasets(cfg, 3)
    x, y = train.tensors
    assert x.shape == (64, 16) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, again.tensors[0]) and not torch.equal(x[:8], held.tensors[0][:8])  # seeded; held out differs
    successors = {}  # each token is followed by at most SUCCESSORS tokens, in the train and held-out sets alike
    for a, b in zip(
        torch.cat([x, held.tensors[0]]).flatten().tolist(), torch.cat([y, held.tensors[1]]).flatten().tolist()
    ):
        successors.setdefault(a, set()).add(b)
    assert max(map(len, successors.values())) <= SUCCESSORS
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    train, held = load_datasets(OmegaConf.create({"name": "tokens", "seq": 50, "path": str(text)}), 0)
    assert torch.equal(train.tensors[0][1, :3], torch.tensor([50, 51, 52])) and len(train) + len(held) == 1023 // 50
    assert torch.equal(train.tensors[1][:, :-1], train.tensors[0][:, 1:])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("model=gpt",), "model=gpt reads token ids, not data=synthetic; use data=tokens"),
        (("model=vit", "data=tokens"), "model=vit reads images, not data=tokens"),
        (("model=gpt", "data=tokens", "data.seq=32"), "data.seq=32 differs from model.seq=64"),
        (("model=gpt", "data=tokens", "data.vocab=300"), "model.vocab=256 is smaller than the data's vocabulary (300)"),
    ],
)
def test_bad_model_and_data_pairs_are_refused_in_one_line(overrides, message):
    from parallel_lab.config import validate
    from tests.support.cli import compose_cfg

    with pytest.raises(ConfigError, match=r"^[^\n]*; [^\n]*$") as err:
        validate(compose_cfg("strategy=single", *overrides))  # a later strategy= wins
    assert message in str(err.value)


def test_the_command_line_refuses_a_small_vocabulary_for_a_text_file_with_exit_2(tmp_path):
    from tests.support.cli import assert_one_clean_line, run_cli

    text, run_dir = tmp_path / "t.txt", tmp_path / "run"
    text.write_bytes(b"hello " * 2000)
    result = run_cli(
        run_dir, "model=gpt", "data=tokens", f"data.path={text}", "model.vocab=64", check=False, timeout=120
    )
    assert_one_clean_line(result, run_dir, "model.vocab=64 is smaller than the data's vocabulary (256)")
    assert result.returncode == 2 and not run_dir.exists()


def test_planned_pp_activations_equal_each_stages_real_forward():
    """pp at world 2 (untied): the first stage stashes its micro-batches' embedding and block
    activations, the last its blocks', head's and loss's, as many as the schedule keeps in flight."""
    from collections import OrderedDict

    from parallel_lab.config import validate
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from parallel_lab.strategies.pp.rules import chunk_names
    from tests.support.activations import saved_by_forward
    from tests.support.cli import compose_cfg
    from tests.support.reference import GPT_RUN

    cfg = validate(compose_cfg(*GPT_RUN, "strategy=pp", "model.tied=false", "world_size=2", "trainer.global_batch=8"))
    meta, real = build_meta_model(cfg.model), build_model(cfg.model, 0)
    plans = plan_world(cfg, get_strategy_class("pp"), meta)
    m = cfg.strategy.microbatches
    stash = [m, m] if cfg.strategy.schedule == "gpipe" else [min(m, 2), min(m, 1)]
    first, last = (
        torch.nn.Sequential(OrderedDict((n, real.get_submodule(n)) for n in c)) for c in chunk_names(cfg, meta)
    )
    x = torch.randint(0, 64, (8 // m, 32))
    sent = first(x).detach().requires_grad_()  # what stage 1 receives

    assert plans[0].activation_bytes == stash[0] * saved_by_forward(first, x, loss=False)
    assert plans[1].activation_bytes == stash[1] * saved_by_forward(last, sent, loss=True)


@pytest.mark.parametrize("world", [2, 3])
def test_pp_plans_the_tied_embeddings_copy_on_the_last_stage_and_its_all_reduce(world):
    """Tied under pp (strategies/pp/tied.py): the last stage holds a V x h copy of the embedding
    where the untied one holds its own V x h projection, so every rank's planned model state and
    activations equal the untied run's, and the two ends (not a middle stage) add the all-reduce
    of the copy's fp32 gradient: 2 x 4 V h bytes in the counter's units."""
    from parallel_lab.config import validate
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.predict import plan_world
    from parallel_lab.strategies import get_strategy_class
    from tests.support.cli import compose_cfg
    from tests.support.reference import GPT_RUN, GPT_SIZES

    def plans(tied: str):
        run = (*GPT_RUN, "strategy=pp", f"model.tied={tied}", f"world_size={world}", f"strategy.stages={world}")
        cfg = validate(compose_cfg(*run, "trainer.global_batch=8"))
        return plan_world(cfg, get_strategy_class("pp"), build_meta_model(cfg.model))

    tied, untied = plans("true"), plans("false")
    copy = 2.0 * 4 * GPT_SIZES["vocab"] * GPT_SIZES["hidden"]
    for rank, (t, u) in enumerate(zip(tied, untied, strict=True)):
        assert t.state == u.state and t.activation_bytes == u.activation_bytes, rank
        ends = copy if rank in (0, world - 1) else 0.0
        assert t.comm.get("all_reduce", 0.0) == u.comm.get("all_reduce", 0.0) + ends, (rank, t.comm, u.comm)
        assert t.comm["isend"] == u.comm["isend"], rank
