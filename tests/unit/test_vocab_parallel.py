"""The gpt's vocabulary split (tp/vocab.py) piece by piece on 2 real gloo ranks, each piece against
torch's own op on the whole vocabulary computed here: the vocab-parallel cross-entropy against
F.cross_entropy (loss and the gradient of every logit), the vocab-parallel embedding against
F.embedding (output and the gradient of every row), the gathered logits against the whole ones,
and the bytes each sends. The whole model under strategy=tp: tests/integration/test_tp_gpt.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

BATCH, VOCAB, SEQ, HIDDEN = 3, 10, 5, 4


def _inputs() -> dict[str, torch.Tensor]:
    """The whole tensors, the same on every rank and in the parent. The logits' scale makes the
    ranks' maxima differ a lot: a rank shifting by its own max instead of the global one fails."""
    gen = torch.Generator().manual_seed(11)
    return {
        "logits": 8 * torch.randn(BATCH, VOCAB, SEQ, generator=gen),
        "targets": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        "weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "upstream": torch.randn(BATCH, SEQ, HIDDEN, generator=gen),
    }


def vocab_body(rank: int, world_size: int) -> None:
    """Each rank: its columns of the logits and rows of the embedding through tp/vocab.py."""
    from parallel_lab.comm.counter import CommCounter
    from parallel_lab.strategies.tp.megatron import TPGroup
    from parallel_lab.strategies.tp.vocab import VocabParallelEmbedding, gather_vocab, vocab_parallel_cross_entropy

    t, tp = _inputs(), TPGroup(None, rank, world_size)
    logits = t["logits"].chunk(world_size, 1)[rank].clone().requires_grad_()
    embedding = VocabParallelEmbedding(torch.nn.Embedding.from_pretrained(t["weight"], freeze=False), tp)
    counter = CommCounter().install()
    with counter.counting():
        loss = vocab_parallel_cross_entropy(logits, t["targets"], tp)
        loss.backward()
        loss_bytes = dict(counter.bytes_by_op)
        looked_up = embedding(t["targets"])
        looked_up.backward(t["upstream"])
    gathered = gather_vocab(logits.detach(), tp)
    counter.uninstall()
    out = {"loss": loss.item(), "grad": logits.grad.tolist(), "loss_bytes": loss_bytes}
    out |= {"embedding": looked_up.tolist(), "rows_grad": embedding.weight.grad.tolist(), "gathered": gathered.tolist()}
    out["all_bytes"] = dict(counter.bytes_by_op)
    print(json.dumps(out))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from parallel_lab.cli.run import run_ranks

    return [json.loads(o.strip().splitlines()[-1]) for o in run_ranks(vocab_body, 2, timeout=120)]


def _whole() -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    t = _inputs()
    logits = t["logits"].clone().requires_grad_()
    F.cross_entropy(logits, t["targets"]).backward()
    weight = t["weight"].clone().requires_grad_()
    out = F.embedding(t["targets"], weight)
    out.backward(t["upstream"])
    return t, logits.grad, out.detach(), weight.grad


@pytest.mark.slow
@pytest.mark.floats
def test_vocab_parallel_cross_entropy_is_torchs_loss_and_gradient(ranks):
    """Every rank returns F.cross_entropy's mean loss; each rank's logit gradient is its columns of
    torch's (softmax minus the one-hot target, over all tokens); 3 all-reduces of (batch, seq) fp32."""
    t, grad, _, _ = _whole()
    want = F.cross_entropy(t["logits"], t["targets"]).item()
    for rank, got in enumerate(ranks):
        assert got["loss"] == pytest.approx(want, rel=1e-6, abs=1e-6), (rank, got["loss"], want)
        torch.testing.assert_close(torch.tensor(got["grad"]), grad.chunk(2, 1)[rank], rtol=1e-5, atol=1e-7)
        assert got["loss_bytes"] == {"all_reduce": 3 * 2 * 4 * BATCH * SEQ}, got["loss_bytes"]


@pytest.mark.slow
@pytest.mark.floats
def test_vocab_parallel_embedding_is_torchs_lookup_and_row_gradients(ranks):
    """The summed partial lookups are F.embedding's (rank 1's rows start at VOCAB / 2: a wrong offset
    looks up the wrong rows); each rank's rows get exactly their ids' gradient, with no backward
    communication: one all-reduce of (batch, seq, hidden) forward."""
    t, _, embedded, rows = _whole()
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(got["embedding"]), embedded, rtol=0, atol=0)  # one owner per id: exact
        torch.testing.assert_close(torch.tensor(got["rows_grad"]), rows.chunk(2, 0)[rank], rtol=1e-6, atol=1e-7)
        lookup = 2 * 4 * BATCH * SEQ * HIDDEN
        assert got["all_bytes"]["all_reduce"] - got["loss_bytes"]["all_reduce"] == lookup, got["all_bytes"]


@pytest.mark.slow
def test_gathered_logits_are_the_whole_vocabulary_in_order(ranks):
    """Evaluation's argmax reads every column: the ranks' shards concatenated in rank order."""
    whole = _inputs()["logits"]
    for got in ranks:
        assert torch.equal(torch.tensor(got["gathered"]), whole)
