"""Data pipeline: built-in corpus, tokenizer training, preparation into token shards, loaders.

The training engine calls::

    prepared = prepare_from_config(cfg.data)                      # build or reuse, rank 0 only
    check_compatible(prepared, cfg.model.vocab_size)               # tokenizer vs model
    train = TrainLoader(prepared, cfg.train.seq_len, cfg.train.micro_batch_size, seed=cfg.data.seed)
    valid = validation_loaders(prepared, cfg.train.seq_len, cfg.train.micro_batch_size)

The ``data:`` section itself (:class:`DataConfig`) is part of the config package
(:mod:`smelt_ds.config.data`), so reading a recipe never imports ``datasets``.
"""

from __future__ import annotations

from smelt_ds.config.data import DataConfig, SourceConfig, TokenizerConfig
from smelt_ds.data.builtin import build_builtin_corpus, builtin_corpus_dir
from smelt_ds.data.loader import TrainLoader, ValidationLoader, check_compatible, validation_loaders
from smelt_ds.data.prepare import PreparedData, build_tokenizer, prepare_from_config, token_dtype
from smelt_ds.data.tokenizer import load_tokenizer, tokenizer_hash, train_tokenizer

__all__ = ["DataConfig", "SourceConfig", "TokenizerConfig", "PreparedData", "prepare_from_config", "build_tokenizer",
           "token_dtype", "TrainLoader", "ValidationLoader", "validation_loaders", "check_compatible",
           "build_builtin_corpus", "builtin_corpus_dir", "train_tokenizer", "tokenizer_hash", "load_tokenizer"]
