"""A small English text corpus, tokenized as bytes, for demos and tests.

>>> ds = TextDataset(seq_len=64)
>>> ds[0]["input_ids"].shape, ds.vocab_size
(torch.Size([64]), 256)
"""

from __future__ import annotations

import os
from importlib import resources

import torch
from torch.utils.data import Dataset

__all__ = ["TextDataset", "corpus_path"]


def corpus_path() -> str:
    """The path of the bundled corpus (plain ASCII essays, about 27 KB)."""
    return str(resources.files(__name__).joinpath("corpus.txt"))


class TextDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` byte tokens (vocabulary 256) of a text file.

    Each item is ``{"input_ids": LongTensor(seq_len)}``; a causal-LM loss shifts the
    targets itself. The tail that does not fill a whole window is dropped.
    """

    vocab_size = 256

    def __init__(self, seq_len: int, path: str | os.PathLike | None = None) -> None:
        if seq_len < 2:
            raise ValueError(f"TextDataset(seq_len={seq_len}): need at least 2 tokens per window")
        with open(path if path is not None else corpus_path(), "rb") as f:
            data = f.read()
        n = len(data) // seq_len
        if n == 0:
            raise ValueError(f"TextDataset: {len(data)} bytes hold no window of {seq_len} tokens")
        self.seq_len = seq_len
        self.tokens = torch.frombuffer(bytearray(data[:n * seq_len]), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} windows")
        i %= len(self)
        return {"input_ids": self.tokens[i * self.seq_len:(i + 1) * self.seq_len]}

    @staticmethod
    def decode(ids) -> str:
        """Bytes back to text (invalid bytes replaced)."""
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")
