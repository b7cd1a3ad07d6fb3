"""Evaluation and mechanism analysis of SMELT and Baseline checkpoints (opened as CPU models by
:mod:`smelt_ds.runs.load`).

- :mod:`smelt_ds.eval.data`: validation windows per domain, bytes per token.
- :mod:`smelt_ds.eval.loss`: loss per domain (nats/token), bits per byte, loss by position (the
  definition, shared with training's validation: :mod:`smelt_ds.runs.validation_loss`).
- :mod:`smelt_ds.eval.icl`: in-context learning tasks and curves over k examples.
- :mod:`smelt_ds.eval.generation`: decoding with the per-visit KV cache, tokens/s.
- :mod:`smelt_ds.eval.analysis`: attention sink, routing divergence, logit lens per (layer, visit).
- :mod:`smelt_ds.eval.suite`: several runs at once; :mod:`smelt_ds.eval.report` tables;
  :mod:`smelt_ds.eval.plots` PNGs.
- :mod:`smelt_ds.eval.curves`: training curves of run directories (``smelt-ds plot``: PNG + CSV).

Commands: ``smelt-ds eval``, ``smelt-ds analyze``, ``smelt-ds generate`` (:mod:`smelt_ds.eval.cli`), ``smelt-ds plot``
(:mod:`smelt_ds.eval.curves`).
"""
