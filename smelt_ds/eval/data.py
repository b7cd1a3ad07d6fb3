"""Evaluation data: the prepared validation windows of each domain, the tokenizer, and the UTF-8
bytes each token stands for (for bits per byte).

Domains (e.g. ``code`` and ``text`` of the built-in corpus) come from the prepared data's metadata
(``meta.json``: each source's ``domain``). Validation windows are read by
:class:`smelt_ds.data.loader.ValidationLoader` on one rank, in shard order: the same windows for
every run that uses the same prepared data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from smelt_ds.config.data import DataConfig
from smelt_ds.data.loader import ValidationLoader, check_compatible
from smelt_ds.data.prepare import prepare_from_config
from smelt_ds.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from smelt_ds.data.prepared import PreparedData

__all__ = ["EvalData", "bytes_to_unicode", "token_byte_lengths", "open_eval_data"]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ``ByteLevel`` pre-tokenizer and
    decoder of ``tokenizers`` use (Radford et al. 2019, ``encoder.py``)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 bytes of text each token id stands for, shape ``(V,)`` int64 (units: bytes).

    Byte-level BPE (``ByteLevel`` decoder): each character of a token's string is one byte
    (GPT-2's byte <-> character table). Special (added) tokens such as end-of-text count 0 bytes:
    they are document separators, not text. Other tokenizers: bytes of ``decode([id])``.
    """
    V = tokenizer.get_vocab_size()
    special = set(tokenizer.get_added_tokens_decoder())
    out = np.zeros(V, dtype=np.int64)
    byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
    alphabet = set(bytes_to_unicode().values())
    for i in range(V):
        if i in special:
            continue
        tok = tokenizer.id_to_token(i)
        if byte_level and tok is not None and all(c in alphabet for c in tok):
            out[i] = len(tok)
        else:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


@dataclass
class EvalData:
    """A run's prepared data as the evaluation needs it.

    Attributes:
        prepared: :class:`smelt_ds.data.PreparedData`.
        tokenizer: the ``tokenizers.Tokenizer`` the shards were made with.
        byte_lengths: ``(V,)`` UTF-8 bytes per token id (see :func:`token_byte_lengths`).
        domains: validation domains in source order.
        split: the prepared split read (``validation``; ``train`` for an evaluation corpus).
    """

    prepared: PreparedData
    tokenizer: Tokenizer
    byte_lengths: np.ndarray
    domains: list[str]
    split: str = "validation"

    @property
    def eot_id(self) -> int:
        return self.prepared.eot_id

    @property
    def key(self) -> str:
        return self.prepared.key

    def batches(self, domain: str, seq_len: int, micro_batch_size: int, max_batches: int | None,
                ranks: int = 1) -> list[dict]:
        """Validation micro-batches of ``domain``: ``{"input_ids": (B, S), "labels": (B, S)}`` int64,
        windows of ``seq_len + 1`` tokens in shard order, at most ``max_batches``.

        ``ranks`` > 1 reads the windows as training's validation does on that many data-parallel
        ranks (:class:`smelt_ds.data.loader.ValidationLoader`): rank r takes windows r, r + ranks,
        ... up to ``max_batches`` micro-batches, and the batches of rank 0, 1, ... are returned one
        after the other (the same micro-batches, so the same numbers, as the ranks together).
        Raises ConfigError when the domain holds fewer windows than ``ranks``."""
        out = []
        for rank in range(ranks):
            vl = ValidationLoader(self.prepared, domain, seq_len, micro_batch_size, dp_rank=rank, dp_world_size=ranks,
                                  max_batches=max_batches, split=self.split)
            out += [{"input_ids": b["input_ids"], "labels": b["labels"]} for b in vl]
        return out

    def text_of(self, domain: str, max_tokens: int) -> str:
        """Decoded text of the first ``max_tokens`` validation tokens of ``domain`` (documents
        separated by end-of-text are joined with newlines)."""
        parts, seen = [], 0
        for shard in self.prepared.shards(self.split, domain=domain):
            toks = np.asarray(self.prepared.tokens(shard)[: max(0, max_tokens - seen)], dtype=np.int64)
            seen += len(toks)
            docs = np.split(toks, np.flatnonzero(toks == self.eot_id))
            parts += [self.tokenizer.decode([int(t) for t in d if t != self.eot_id]) for d in docs]
            if seen >= max_tokens:
                break
        return "\n".join(p for p in parts if p)

def open_eval_data(cfg, split: str = "validation") -> EvalData:
    """Prepare (or reuse) the recipe's data section and check it fits the model.

    ``split``: ``validation`` (the run's held-out documents) or ``train`` (every document of an
    evaluation corpus, see :func:`corpus_config`). Raises ConfigError when the tokenizer
    vocabulary differs from ``model.vocab_size`` or the split is empty.
    """

    prepared = prepare_from_config(cfg.data)
    check_compatible(prepared, cfg.model.vocab_size)
    domains = [d for d in prepared.domains if prepared.shards(split, domain=d)]
    if not domains:
        raise ConfigError(f"prepared data {prepared.root} hold no {split} shards (`data.validation_share` "
                          f"is {cfg.data.validation_share}): set data.validation_share > 0 (e.g. --set "
                          "data.validation_share=0.05) so the data are prepared with a validation split")
    tok = prepared.tokenizer()
    return EvalData(prepared, tok, token_byte_lengths(tok), domains, split)


def corpus_config(cfg, paths: list[str]):
    """``cfg`` whose data section reads ``paths`` (files or directories; one domain per path,
    named by its stem) in full: ``validation_share`` 0 puts every document in the ``train``
    split, which the evaluation then reads. The tokenizer is kept (the run's, see
    :func:`smelt_ds.runs.load.load_run`). Raises ConfigError for a path that does not exist."""
    from pathlib import Path


    for p in paths:
        if not Path(p).exists():
            raise ConfigError(f"`--corpus` {p!r} does not exist: pass text, JSONL or Parquet files or directories")
    raw = cfg.data.model_dump(mode="json")
    raw.update(sources=[{"path": str(p)} for p in paths], validation_share=0.0)
    return cfg.model_copy(update={"data": DataConfig.model_validate(raw)})
