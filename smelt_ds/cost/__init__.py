"""Analytic costs, no DeepSpeed, no process group and no device query: the three budgets
(per-token FLOPs, non-embedding parameters, KV cache), matching a looped recipe to its Baseline,
the terms of memory per GPU and the loop-aware ZeRO-3 plan for a given device memory and precision.

- :mod:`smelt_ds.cost.budget`, :mod:`smelt_ds.cost.memory_terms`, :mod:`smelt_ds.cost.zero3_tuning`,
  :mod:`smelt_ds.cost.precision` (planned for a GPU), :mod:`smelt_ds.cost.activation_checkpointing`.
- Commands: ``smelt-ds budget``, ``smelt-ds match`` (:mod:`smelt_ds.cost.cli`).
- The DeepSpeed sections these costs feed, and the memory table built from them, are one floor
  up: :mod:`smelt_ds.parallel.zero_section`, :mod:`smelt_ds.parallel.memory`.
"""
