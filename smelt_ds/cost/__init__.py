"""Analytic costs, no DeepSpeed and no process group: the three budgets (per-token FLOPs,
non-embedding parameters, KV cache), matching a looped recipe to its Baseline, memory estimates per
ZeRO option and the loop-aware ZeRO-3 plan.

- :mod:`smelt_ds.cost.budget`, :mod:`smelt_ds.cost.memory`, :mod:`smelt_ds.cost.zero3_tuning`.
- Commands: ``smelt-ds budget``, ``smelt-ds match`` (:mod:`smelt_ds.cost.cli`).
"""
