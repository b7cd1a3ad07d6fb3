"""The run-config tree, validated once at load time (pydantic), and the facts derived from it.

- :mod:`smelt_ds.config.run`: :class:`RunConfig`, the whole recipe, and the checks between sections.
- One module per section, its checks beside its fields: :mod:`~smelt_ds.config.model`,
  :mod:`~smelt_ds.config.moe` (``moe`` and ``moe_runtime``), :mod:`~smelt_ds.config.loop`,
  :mod:`~smelt_ds.config.data`, :mod:`~smelt_ds.config.train`, :mod:`~smelt_ds.config.deepspeed_section`,
  :mod:`~smelt_ds.config.eval`, :mod:`~smelt_ds.config.cluster`, :mod:`~smelt_ds.config.tracking`,
  :mod:`~smelt_ds.config.profile`; :mod:`smelt_ds.config.schema` their strict pydantic base model.
- :mod:`smelt_ds.config.loading`: a recipe file (``base:`` chains, ``--set`` overrides) into a
  validated :class:`RunConfig`, errors naming the file and line or the ``--set`` item; dump.
- :mod:`smelt_ds.config.schedule`: :class:`LoopSchedule`, the visit plan a config's ``loop:`` means.
- :mod:`smelt_ds.config.reference`: docs/configuration.md written from the fields' descriptions.
"""
