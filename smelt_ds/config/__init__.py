"""The run-config tree, validated once at load time (pydantic), and the facts derived from it.

- :mod:`smelt_ds.config.schema`: the strict pydantic base model.
- :mod:`smelt_ds.config.data`: the ``data:`` section (sources, tokenizer, splits).
- :mod:`smelt_ds.config.schedule`: :class:`LoopSchedule`, the visit plan a config's ``loop:`` means.
- :mod:`smelt_ds.config.run`: :class:`RunConfig` and its sections; YAML, ``--set`` overrides, dump.
"""
