"""Helpers of the token-source tests: a word-level tokenizer of a chosen size, random documents,
and files written by the formats' own writers (megatron-core's IndexedDatasetBuilder; numpy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

EOT, PAD = 0, 1  # ids of <|endoftext|> and <|pad|> in word_tokenizer


def word_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json with ids 0..size-1: <|endoftext|> (0), <|pad|> (1), then words w2, w3, ..."""
    vocab = {"<|endoftext|>": EOT, "<|pad|>": PAD, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    tok.save(str(path))
    return path


def random_documents(n: int, high: int, seed: int, max_len: int = 80) -> list[np.ndarray]:
    """``n`` documents of ids in [2, high) (never end-of-text or padding); document 3 has one token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, n)
    lengths[3] = 1
    return [rng.integers(2, high, k).astype(np.int64) for k in lengths]


def megatron_builder():
    """megatron-core's IndexedDatasetBuilder (skips the calling test when megatron-core is absent)."""
    mod = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                              reason="megatron-core is not installed (test-only dependency: pip install "
                                     "'smelt-ds[megatron]' or megatron-core); its writer makes the reference files")
    return mod.IndexedDatasetBuilder


def write_megatron(prefix: Path, docs: list[np.ndarray], dtype, eod: int | None = EOT) -> Path:
    """``docs`` through megatron-core's IndexedDatasetBuilder: every other document gets ``eod``
    appended (preprocess_data.py --append-eod does it for all), document 5 is stored as two
    sequences, and an empty document (one sequence of 0 tokens) is added after document 2."""
    builder = megatron_builder()(str(prefix) + ".bin", dtype=dtype)
    for i, d in enumerate(docs):
        ids = np.append(d, eod) if eod is not None and i % 2 == 0 else d
        lengths = [2, len(ids) - 2] if i == 5 and len(ids) > 2 else [len(ids)]
        builder.add_document(ids, lengths)  # numpy arrays: what np.array(tensor) would make of a tensor
        if i == 2:
            builder.add_document(np.zeros(0, dtype=np.int64), [0])
    builder.finalize(str(prefix) + ".idx")
    return prefix


def write_flat(path: Path, docs: list[np.ndarray], dtype, header: bool, tail: bool = True) -> Path:
    """``docs`` as one flat token file, each ended by end-of-text, with numpy's own writers
    (``np.save``: header; ``ndarray.tofile``: raw). ``tail``: the last document has no end-of-text.
    Two end-of-text ids in a row (an empty document) follow document 1."""
    parts = []
    for i, d in enumerate(docs):
        parts.append(d)
        if i < len(docs) - 1 or not tail:
            parts.append([EOT])
        if i == 1:
            parts.append([EOT])
    ids = np.concatenate(parts).astype(dtype)
    if header:
        np.save(path, ids)  # np.save appends .npy when missing: give paths ending in .npy
    else:
        ids.tofile(path)
    return path


def packed(docs: list[np.ndarray]) -> list[list[int]]:
    """What the packed stream must hold per document: its ids, then one end-of-text."""
    return [d.tolist() + [EOT] for d in docs]


def read_split(prepared, split: str, domain: str | None = None) -> np.ndarray:
    """The packed stream of a split (all its shards in order), int64."""
    shards = prepared.shards(split, domain=domain)
    return np.concatenate([np.asarray(prepared.tokens(s), dtype=np.int64) for s in shards]) if shards else \
        np.empty(0, dtype=np.int64)
