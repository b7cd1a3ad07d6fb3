"""Training: build the model and engine, the fit loop with metrics, the run directory and its resume
guards, checkpoints (atomic, verified), the reference-layout weights and export.

- :mod:`smelt_ds.train.loop`: ``build()``, ``train()``, metrics, summary; ``python -m smelt_ds.train``.
- :mod:`smelt_ds.train.data`: the training and validation loaders of a run.
- :mod:`smelt_ds.train.checkpoint`, :mod:`smelt_ds.train.reference_weights`, :mod:`smelt_ds.train.export`.
- :mod:`smelt_ds.train.run_lock`, :mod:`smelt_ds.train.provenance` (the run's tokenizer).
- Commands: ``smelt-ds train``, ``smelt-ds export`` (:mod:`smelt_ds.train.cli`).
"""
