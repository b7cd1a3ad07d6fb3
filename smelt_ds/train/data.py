"""The training run's view of the data pipeline: prepared shards, this rank's loaders.

Only one process tokenises (:func:`smelt_ds.data.prepare_from_config` lets the preparing rank
work while the others wait for its completion marker); every rank then opens the same shards.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.config.train import resolve_batch
from smelt_ds.data.loader import TrainLoader, validation_loaders
from smelt_ds.data.prepare import prepare_from_config
from smelt_ds.data.tokenizer import unused_vocab_size

__all__ = ["Batch", "TrainData", "build_data", "unigram_entropy"]


@dataclass
class Batch:
    """One micro-batch: ``input_ids`` and ``labels`` ``(B, S)`` int64, ``sample_ids`` ``(B,)``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor


class TrainData:
    """This rank's training loader (resumable) and validation loaders per domain."""

    def __init__(self, prepared, loader, val_loaders: dict[str, Any]):
        self.prepared, self.loader, self.val_loaders = prepared, loader, val_loaders
        self.train = self  # train.py reads data.train.next_batch() / state_dict()
        self._entropy: float | None = None

    def next_batch(self) -> Batch:
        return Batch(**next(self.loader))

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def validation(self, max_batches: int) -> dict[str, list[Batch]]:
        """Up to ``max_batches`` validation micro-batches of every domain (same on every call)."""
        out = {}
        for domain, vl in self.val_loaders.items():
            batches = []
            for i, b in enumerate(vl):
                if i >= max_batches:
                    break
                batches.append(Batch(**b))
            out[domain] = batches
        return out

    @property
    def unigram_entropy(self) -> float:
        """Unigram entropy of the training tokens (nats/token), the loss of a model that ignores
        context: a trained LM must go clearly below it."""
        if self._entropy is None:
            self._entropy = unigram_entropy(self.prepared)
        return self._entropy


def unigram_entropy(prepared, max_tokens: int = 50_000_000) -> float:
    """``-sum_v p_v ln p_v`` over the first ``max_tokens`` training tokens (nats/token)."""
    counts = np.zeros(prepared.vocab_size, dtype=np.int64)
    seen = 0
    for shard in prepared.shards("train"):
        toks = np.asarray(prepared.tokens(shard)[: max(0, max_tokens - seen)])
        counts += np.bincount(toks, minlength=prepared.vocab_size)[: prepared.vocab_size]
        seen += len(toks)
        if seen >= max_tokens:
            break
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build_data(cfg: RunConfig, rank: int, world_size: int) -> TrainData:
    """Prepare (or reuse) the recipe's data and open this rank's loaders.

    Raises ConfigError when the data do not fit the model (vocabulary, tokenizer) or hold too
    few tokens for one window of ``train.seq_len + 1``.
    """

    prepared = prepare_from_config(cfg.data)
    unused = unused_vocab_size(cfg.data.tokenizer, prepared.vocab_size, cfg.model.vocab_size)
    if unused and rank == 0:  # what `smelt-ds preflight` warns of; the run is unaffected
        print(f"smelt-ds data: warning: {unused}", file=sys.stderr, flush=True)
    t = cfg.train
    accum, _ = resolve_batch(t, world_size)
    loader = TrainLoader(prepared, t.seq_len, t.micro_batch_size, seed=cfg.data.seed, dp_rank=rank,
                         dp_world_size=world_size, model_vocab_size=cfg.model.vocab_size,
                         epoch_unit=t.micro_batch_size * accum * world_size)  # the optimizer step's samples
    vals = validation_loaders(prepared, t.seq_len, t.micro_batch_size, dp_rank=rank, dp_world_size=world_size,
                              max_batches=cfg.eval.eval_batches)
    return TrainData(prepared, loader, vals)
