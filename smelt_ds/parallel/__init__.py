"""DeepSpeed applied from outside the model: the DeepSpeed config and engine, activation-checkpointing
wiring, MoE backends (DeepSpeed-MoE, AutoEP), the global gradient norm with expert parallelism, and
the memory table of the ZeRO options the config can take.

- :mod:`smelt_ds.parallel.ds_config` (the DeepSpeed config), :mod:`smelt_ds.parallel.zero_section`
  (its ``zero_optimization`` section), :mod:`smelt_ds.parallel.hardware` (this machine's precision
  and device memory), :mod:`smelt_ds.parallel.memory`, :mod:`smelt_ds.parallel.engine`,
  :mod:`smelt_ds.parallel.moe_backends`, :mod:`smelt_ds.parallel.grad_norm`.
"""
