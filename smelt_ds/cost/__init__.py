"""Analytic costs, no DeepSpeed and no process group: the three budgets (per-token FLOPs,
non-embedding parameters, KV cache), matching a looped recipe to its Baseline, memory estimates per
ZeRO option and the loop-aware ZeRO-3 plan.

- :mod:`smelt_ds.cost.budget`, :mod:`smelt_ds.cost.memory`, :mod:`smelt_ds.cost.zero3_tuning`.
- The facts of the DeepSpeed config: :mod:`smelt_ds.cost.zero_config` (template, ``zero_optimization``),
  :mod:`smelt_ds.cost.precision`, :mod:`smelt_ds.cost.activation_checkpointing`.
- Commands: ``smelt-ds budget``, ``smelt-ds match`` (:mod:`smelt_ds.cost.cli`).
"""
