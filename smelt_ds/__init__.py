"""smelt-ds: a DeepSpeed training stack for SMELT (Sparse MoE Transformer, middle layers Loop Twice)
and its budget-matched Baselines (arXiv 2609.01343)."""

__version__ = "0.1.0"

from smelt_ds import import_hooks as _import_hooks

_import_hooks.install()
