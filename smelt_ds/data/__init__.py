"""Data pipeline: built-in corpus, tokenizer training, preparation into token shards, loaders.

The training engine calls::

    prepared = prepare_from_config(cfg.data)                      # data.prepare; build or reuse, rank 0 only
    check_compatible(prepared, cfg.model.vocab_size)               # data.loader; tokenizer vs model
    train = TrainLoader(prepared, cfg.train.seq_len, cfg.train.micro_batch_size, seed=cfg.data.seed)
    valid = validation_loaders(prepared, cfg.train.seq_len, cfg.train.micro_batch_size)

Modules: :mod:`~smelt_ds.data.builtin` (the built-in corpus), :mod:`~smelt_ds.data.sources`
(files, Hugging Face datasets), :mod:`~smelt_ds.data.token_files` (Megatron .bin/.idx and flat
numpy token files), :mod:`~smelt_ds.data.token_sources` (their preparation and packed streams),
:mod:`~smelt_ds.data.tokenizer`, :mod:`~smelt_ds.data.prepare`,
:mod:`~smelt_ds.data.loader`, :mod:`~smelt_ds.data.cache`, :mod:`~smelt_ds.data.distributed`,
:mod:`~smelt_ds.data.token_writers` (writers of those formats),
:mod:`~smelt_ds.data.pretokenize` (``smelt-ds data tokenize``), :mod:`~smelt_ds.data.cli`. The
``data:`` section itself (``DataConfig``) is :mod:`smelt_ds.config.data`. This package imports
nothing itself, so that reading a tokenizer (``data.tokenizer``) does not import ``datasets``.
"""
