"""The replica check: at the end of a run, the ranks that hold the same copy of a parameter
(data-parallel replicas: ``Strategy.replica_parameters`` names what each rank holds) must hold it
bit for bit.

Why exact: data parallelism (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3) keeps replicas
identical by giving every rank the same averaged gradient, and an all-reduce that reduces each
chunk once and hands the result to every rank (gloo's ring, the hand-written ring and star of
comm/) delivers the same bytes everywhere; the same bytes through the same optimizer give the same
weights. A missed all-reduce late in a run leaves the losses within the parity envelope
(docs/parity.md) but splits the replicas at once.

Each rank digests every parameter it holds (sha256 of the raw bytes); the digests are gathered
(``all_gather_object``: collective, every rank calls it) and compared key by key (a tied
pipeline's two ends: one key, ``tie_pipeline_ends``). metrics.json: ``replica_digests_agree``
(None: no parameter is held by two ranks, e.g. world 1, untied pure pp, flat FSDP, fsdp x cp,
ZeRO-3) and ``replica_groups_disagree`` (each group of ranks whose copies differ, with the first
parameters that do).
"""

from __future__ import annotations

import hashlib

import torch

from parallel_lab.worker.metrics import gather_from_ranks

SHOWN_PARAMS = 4  # parameters named per disagreeing group in metrics.json


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (its dtype's, not a float's rendering)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def compare(per_rank: list[dict[str, str]]) -> dict:
    """{replica_digests_agree, replica_groups, replica_groups_disagree} from every rank's
    {key: digest}, in rank order: the ranks holding one key form its replica group."""
    holders: dict[str, dict[int, str]] = {}
    for rank, digests in enumerate(per_rank):
        for key, value in digests.items():
            holders.setdefault(key, {})[rank] = value
    groups: list[list[int]] = []
    bad: dict[tuple[int, ...], list[str]] = {}
    for key, by_rank in holders.items():
        ranks = sorted(by_rank)
        if len(ranks) < 2:
            continue
        if ranks not in groups:
            groups.append(ranks)
        if len(set(by_rank.values())) > 1:
            bad.setdefault(tuple(ranks), []).append(key)
    disagree = [{"ranks": list(r), "params": keys[:SHOWN_PARAMS], "count": len(keys)} for r, keys in bad.items()]
    return {
        "replica_digests_agree": (not disagree) if groups else None,
        "replica_groups": sorted(groups),
        "replica_groups_disagree": disagree,
    }


def tie_pipeline_ends(strategy, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tied gpt under pp (``strategies/pp/tied.py``, Megatron's layout): the first and the last
    stage each hold a copy of the word embedding, kept bit-equal by the embedding group's gradient
    sum. Their keys differ by the pp coordinate; here both ends' copy takes one key without it
    (``tied:`` + the weight's name in single), so the check compares the ends like replicas."""
    if getattr(strategy, "embedding_group", None) is None:  # not an end of a tied pipeline
        return held
    from parallel_lab.strategies.pp.tied import EMBED, tied_weight

    ptr, out = tied_weight(strategy).data_ptr(), {}
    for key, t in held.items():
        if t.data_ptr() != ptr:
            out[key] = t
            continue
        where = [d for d in key.split(",")[:-1] if not d.startswith("pp=")]  # the tp shard stays apart
        out[",".join([*where, f"tied:{EMBED}.tokens.weight"])] = t
    return out


def replica_record(strategy) -> dict:
    """Digest this rank's replica_parameters(), gather every rank's, compare (collective)."""
    held = tie_pipeline_ends(strategy, strategy.replica_parameters())
    return compare(gather_from_ranks({key: digest(t) for key, t in held.items()}))
