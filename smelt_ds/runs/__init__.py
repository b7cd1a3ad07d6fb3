"""The run directory and everything written into it: training writes these artifacts; evaluation,
Hugging Face interop and the study read them through this package.

- :mod:`smelt_ds.runs.checkpoint`: atomic, hashed, verified checkpoints; the ``COMPLETE`` marker
  with the layout; resume, damage detection, pruning.
- :mod:`smelt_ds.runs.reference_weights`: the reference-layout weight shards gathered from any MoE
  backend, ZeRO stage and expert-parallel size.
- :mod:`smelt_ds.runs.export`: the export format (``model.pt`` + ``config.yaml``) and its loader,
  ``train.init_from``'s initial weights.
- :mod:`smelt_ds.runs.provenance` and :mod:`smelt_ds.runs.tokenizer_file`: the run's tokenizer,
  carried into exports and checked by every reader.
- :mod:`smelt_ds.runs.run_lock`: one training per run directory.
- :mod:`smelt_ds.runs.load`: open run directories, checkpoints and exports as CPU models (what
  evaluation and Hugging Face export read).
- :mod:`smelt_ds.runs.validation_loss`: the one definition of the per-domain validation loss,
  used by training's validation and by ``smelt-ds eval``.

This package imports nothing itself.
"""
