"""``build(cfg, world_size)``: the model, its MoE backend, activation checkpointing and the DeepSpeed
engine, in the order training runs them. Shared by training, measured memory profiling and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.compile import compile_engine, compile_layers
from smelt_ds.parallel.engine import configure_activation_checkpointing, initialize
from smelt_ds.parallel.moe_backends import apply_backend
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.export import load_initial_weights

__all__ = ["Built", "build"]


@dataclass
class Built:
    """What :func:`build` returns: the model (after the MoE backend), the DeepSpeed engine, its
    LR scheduler, the final DeepSpeed config and the checkpoint layout."""

    model: Any
    engine: Any
    scheduler: Any
    ds_config: dict[str, Any]
    layout: dict[str, Any]


def build(cfg: RunConfig, world_size: int) -> Built:
    """Model + MoE backend + ``train.compile`` + activation checkpointing + DeepSpeed engine, as
    training runs it.

    Collective: every rank calls it after torch.distributed is initialised. Seeds torch with
    ``train.seed`` first, then loads ``train.init_from`` (an export) if set. Raises ConfigError
    for a recipe the backend or DeepSpeed refuses, or an unusable ``train.init_from``.
    """

    torch.manual_seed(cfg.train.seed)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    if cfg.train.init_from:  # a checkpoint loaded by --resume replaces these weights

        load_initial_weights(model, cfg.train.init_from)
    if cfg.moe_runtime.backend != "reference":

        model = apply_backend(model, cfg)
    compile_layers(model, cfg)  # train.compile: layers (lazy; ZeRO-3 leaf modules before initialize)
    configure_activation_checkpointing(model, cfg)
    engine, _, sched, ds_config = initialize(cfg, model, world_size)
    compile_engine(engine, cfg)  # train.compile: model, DeepSpeed's engine.compile
    return Built(model, engine, sched, ds_config, ckpt.run_layout(cfg, world_size))
