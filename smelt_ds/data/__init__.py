"""Data pipeline: built-in corpus, tokenizer training, preparation into token shards, loaders.

The training engine calls::

    prepared = prepare_from_config(cfg.data)                      # build or reuse, rank 0 only
    check_compatible(prepared, cfg.model.vocab_size)               # tokenizer vs model
    train = TrainLoader(prepared, cfg.train.seq_len, cfg.train.micro_batch_size, seed=cfg.data.seed)
    valid = validation_loaders(prepared, cfg.train.seq_len, cfg.train.micro_batch_size)

Names are imported lazily so that reading a recipe (``smelt_ds.config`` imports
``smelt_ds.config.data``) does not import ``datasets`` or ``torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataConfig": "smelt_ds.config.data",
    "SourceConfig": "smelt_ds.config.data",
    "TokenizerConfig": "smelt_ds.config.data",
    "PreparedData": "smelt_ds.data.prepare",
    "prepare_from_config": "smelt_ds.data.prepare",
    "build_tokenizer": "smelt_ds.data.prepare",
    "token_dtype": "smelt_ds.data.prepare",
    "TrainLoader": "smelt_ds.data.loader",
    "ValidationLoader": "smelt_ds.data.loader",
    "validation_loaders": "smelt_ds.data.loader",
    "check_compatible": "smelt_ds.data.loader",
    "build_builtin_corpus": "smelt_ds.data.builtin",
    "builtin_corpus_dir": "smelt_ds.data.builtin",
    "train_tokenizer": "smelt_ds.data.tokenizer",
    "tokenizer_hash": "smelt_ds.data.tokenizer",
    "load_tokenizer": "smelt_ds.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'smelt_ds.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
