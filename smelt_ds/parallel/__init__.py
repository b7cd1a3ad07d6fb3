"""DeepSpeed applied from outside the model: the DeepSpeed config and engine, activation-checkpointing
wiring, MoE backends (DeepSpeed-MoE, AutoEP) and the global gradient norm with expert parallelism.

- :mod:`smelt_ds.parallel.ds_config` (the DeepSpeed config), :mod:`smelt_ds.parallel.engine`,
  :mod:`smelt_ds.parallel.moe_backends`, :mod:`smelt_ds.parallel.grad_norm`.
"""
