"""Token sequences for next-token prediction (``data=tokens``): ``(inputs, labels)`` pairs of
int64 (samples, seq), labels the inputs shifted by one token.

- Synthetic (the default): a seeded random chain in which each token is followed by one of
  ``SUCCESSORS`` tokens picked for it, uniformly: a model that learns the table reaches a loss of
  ln(SUCCESSORS) from ln(vocab), so the loss falls as on text. No files, no download.
- ``data.path=<file>``: a text file read as bytes (vocabulary 256), cut into non-overlapping
  windows of seq + 1 bytes; the last tenth of the windows is held out.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from parallel_lab.data.specs import BYTE_VOCAB, file_windows  # noqa: F401  (re-exported)
from parallel_lab.errors import ConfigError

SUCCESSORS = 4  # next tokens each token may have in the synthetic chain: its loss floor is ln 4


def _pairs(windows: torch.Tensor) -> TensorDataset:
    """(samples, seq + 1) tokens -> inputs = all but the last, labels = all but the first."""
    return TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def markov_tokens(size: int, seq: int, vocab: int, seed: int, table_seed: int) -> TensorDataset:
    """``size`` sequences of the chain whose successor table is drawn from ``table_seed`` (the same
    for the training and held-out sets), walked from ``seed``."""
    table = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=torch.Generator().manual_seed(table_seed))
    gen = torch.Generator().manual_seed(seed)
    windows = torch.empty(size, seq + 1, dtype=torch.long)
    windows[:, 0] = torch.randint(0, vocab, (size,), generator=gen)
    picks = torch.randint(0, SUCCESSORS, (size, seq), generator=gen)
    for t in range(seq):
        windows[:, t + 1] = table[windows[:, t], picks[:, t]]
    return _pairs(windows)


def byte_windows(path: str | Path, seq: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, held-out) windows of seq + 1 bytes of the file at ``path``."""
    data = torch.frombuffer(bytearray(Path(path).expanduser().read_bytes()), dtype=torch.uint8).long()
    count = (len(data) - 1) // seq
    if count < 2:
        raise ConfigError(f"data.path={path} holds {len(data)} bytes, fewer than two windows of {seq + 1}")
    windows = torch.stack([data[i * seq : i * seq + seq + 1] for i in range(count)])
    held = max(1, count // 10)
    return _pairs(windows[: count - held]), _pairs(windows[count - held :])
