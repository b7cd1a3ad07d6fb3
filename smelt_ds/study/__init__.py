"""The SMELT experiment on top of training: shipped recipes and derived ablations, scaling sweeps and
Chinchilla fits, and measured memory profiling (real steps next to the estimate).

- :mod:`smelt_ds.study.recipes`, :mod:`smelt_ds.study.sweep`, :mod:`smelt_ds.study.scaling`,
  :mod:`smelt_ds.study.memory_profile`.
- Commands: ``smelt-ds memory``, ``recipes``, ``scaling`` (:mod:`smelt_ds.study.cli`), ``sweep``
  (:mod:`smelt_ds.study.sweep`).
"""
