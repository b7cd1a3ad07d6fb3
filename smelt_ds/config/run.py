"""The recipe schema: one validated config tree per run (docs/architecture.md).

A recipe is a YAML file whose top-level keys are the sections of :class:`RunConfig`; each section
lives in its own module beside the checks between its own fields: ``model``
(:mod:`smelt_ds.config.model`), ``moe`` and ``moe_runtime`` (:mod:`smelt_ds.config.moe`), ``loop``
(:mod:`smelt_ds.config.loop`), ``data`` (:mod:`smelt_ds.config.data`), ``train``
(:mod:`smelt_ds.config.train`), ``deepspeed`` (:mod:`smelt_ds.config.deepspeed_section`), ``eval``
(:mod:`smelt_ds.config.eval`), ``cluster`` (:mod:`smelt_ds.config.cluster`), ``tracking``
(:mod:`smelt_ds.config.tracking`) and ``profile`` (:mod:`smelt_ds.config.profile`). This module
holds the tree and the checks that need several sections (:func:`check_run_config`). Reading a
recipe file, ``--set`` overrides, ``base:`` and the error messages that name where a value came
from are :mod:`smelt_ds.config.loading`'s.

Every violation raises :class:`smelt_ds.errors.ConfigError` whose message names the field path,
the value and the fix.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from smelt_ds.config.cluster import ClusterConfig
from smelt_ds.config.data import DataConfig
from smelt_ds.config.deepspeed_section import DeepSpeedSection, check_deepspeed_keys, check_offload, check_passthrough
from smelt_ds.config.eval import EvalConfig
from smelt_ds.config.loop import LoopConfig
from smelt_ds.config.model import ModelConfig, check_model
from smelt_ds.config.moe import MoEConfig, MoERuntimeConfig, check_moe, check_moe_backend, check_moved_keys
from smelt_ds.config.profile import ProfileConfig
from smelt_ds.config.schedule import LoopSchedule, build_schedule
from smelt_ds.config.schema import StrictModel
from smelt_ds.config.tracking import TrackingConfig
from smelt_ds.config.train import TrainConfig, check_train
from smelt_ds.errors import fail

__all__ = ["RunConfig", "check_run_config"]


class RunConfig(StrictModel):
    """The whole recipe."""

    name: str = Field("smelt", description="run name: fills {name} in train.run_dir and names the run in the "
                                           "console, summary.json and the trackers")
    model: ModelConfig = Field(default_factory=ModelConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    moe_runtime: MoERuntimeConfig = Field(default_factory=MoERuntimeConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw: Any) -> Any:
        check_moved_keys(raw)
        return raw

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        check_run_config(self)
        return self

    @property
    def schedule(self) -> LoopSchedule:
        """The visit plan of this recipe: ``loop`` over ``model.num_layers`` unique layers."""
        return build_schedule(self.loop, self.model.num_layers)


def check_run_config(cfg: RunConfig) -> None:
    """The checks of a parsed config, each section's own (:func:`check_model`, :func:`check_moe`,
    :func:`check_train`, :func:`check_offload`, :func:`check_passthrough`, DeepSpeed's own
    validation of ``deepspeed.config``: :func:`check_deepspeed_keys`, which also reads its numbers
    written ``5e8`` as numbers) and those between
    sections (the MoE backend against the ZeRO stage, the sequence length against the model's,
    compilation, the loop ranges against the depth). Raises ConfigError naming the field path."""
    if not cfg.name.strip() or "/" in cfg.name or "\\" in cfg.name or cfg.name.startswith("."):
        fail("name", cfg.name, "must be a name without '/' (it fills {name} in train.run_dir and names the job) "
             "and must not start with '.'", "e.g. name: m-smelt-pile")
    check_model(cfg.model)
    check_moe(cfg.moe)
    check_passthrough(cfg.deepspeed)  # first: the rules below read the fields that own those keys
    check_moe_backend(cfg.moe, cfg.moe_runtime, cfg.deepspeed.zero_stage)
    if cfg.train.seq_len > cfg.model.max_seq_len:
        fail("train.seq_len", cfg.train.seq_len, f"must be <= `model.max_seq_len` ({cfg.model.max_seq_len})",
              "raise model.max_seq_len or shorten train.seq_len")
    check_train(cfg.train)
    check_offload(cfg.deepspeed)
    read = check_deepspeed_keys(cfg.deepspeed, cfg.train.micro_batch_size)
    if read != cfg.deepspeed.config:
        cfg.deepspeed.config = read
    _check_compile(cfg)
    build_schedule(cfg.loop, cfg.model.num_layers)


def _check_compile(cfg: RunConfig) -> None:
    """``train.compile: model`` (one graph of the whole forward, DeepSpeed's engine.compile) runs
    with the reference MoE at ZeRO 0-2 and without DeepSpeed's activation checkpointing; each other
    combination names ``layers``, which compiles per unique layer and runs everywhere."""
    t = cfg.train
    if t.compile != "model":
        return
    alt = "or use train.compile: layers (each unique layer compiled; every backend and ZeRO stage)"
    if cfg.moe_runtime.backend != "reference":
        fail("train.compile", "model", f"cannot compile moe_runtime.backend {cfg.moe_runtime.backend!r} into one "
             "graph (its all-to-all collectives and capacity bookkeeping stay eager)",
             "use train.compile: layers (the expert layer eager, the rest of each layer compiled)")
    if cfg.deepspeed.zero_stage == 3:
        fail("train.compile", "model", "does not run under ZeRO stage 3 (its parameter hooks on every submodule "
             "are excluded from compilation and split a whole-model graph everywhere)",
             "use train.compile: layers (each layer compiled; under ZeRO-3 its graph breaks at DeepSpeed's "
             "parameter hooks)")
    if t.activation_checkpointing.policy != "none" and t.activation_checkpointing.impl == "deepspeed":
        fail("train.compile", "model", "cannot trace deepspeed.checkpointing (train.activation_checkpointing.impl "
             "'deepspeed')", f"set train.activation_checkpointing.impl: torch, {alt}")
