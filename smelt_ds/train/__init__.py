"""Training: build the model and engine, the fit loop with metrics, the run directory's resume
guards; what a run writes (checkpoints, reference-layout weights, exports, the run's tokenizer and
lock) is :mod:`smelt_ds.runs`.

- :mod:`smelt_ds.train.loop`: ``build()``, ``train()``, metrics, summary; ``python -m smelt_ds.train``.
- :mod:`smelt_ds.train.data`: the training and validation loaders of a run.
- Commands: ``smelt-ds train`` (:mod:`smelt_ds.train.cli`).
"""
