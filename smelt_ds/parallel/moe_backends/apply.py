"""Applying a MoE backend to a built model (:func:`apply_backend`) and what only the running job can
check about it (:func:`check_backend_runtime`)."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from smelt_ds.config.moe import check_moe_backend
from smelt_ds.errors import fail
from smelt_ds.parallel.moe_backends.autoep import install_autoep_prehook
from smelt_ds.parallel.moe_backends.deepspeed_moe import TUTEL_INSTALL_HINT, convert_to_deepspeed_moe, tutel_available

__all__ = ["apply_backend", "check_backend_runtime"]

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


def check_backend_runtime(cfg, zero_stage: int | None = None, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` for what only the running job can tell about ``moe_runtime.backend``.

    What a recipe can never run (e.g. ``deepspeed`` + ZeRO-3, ``score_func: sigmoid``,
    ``aux_loss_free_bias``, ``use_tutel`` with another backend, ``num_experts`` not divisible by
    ``ep_size``) is refused when the recipe is loaded
    (:func:`smelt_ds.config.moe.check_moe_backend`); this adds:

    * ``zero_stage``: the ZeRO stage of the DeepSpeed config actually used, when it is not the
      recipe's (``cfg.deepspeed.zero_stage``): the load-time rules are rerun for it;
    * ``world_size``: the number of ranks, when known (``moe_runtime.ep_size`` must divide it);
    * ``use_tutel`` with the ``deepspeed`` backend: the optional ``tutel`` package must be importable.

    Args:
        cfg: a :class:`smelt_ds.config.run.RunConfig`.
    """
    moe, rt = cfg.moe, cfg.moe_runtime
    if zero_stage is not None and zero_stage != cfg.deepspeed.zero_stage:
        check_moe_backend(moe, rt, zero_stage)
    if rt.backend == "reference":
        return
    if world_size is not None and world_size % rt.ep_size:
        fail("moe_runtime.ep_size", rt.ep_size, f"must divide the number of ranks ({world_size})",
              "launch a multiple of ep_size ranks or lower moe_runtime.ep_size")
    if rt.backend == "deepspeed" and rt.use_tutel and not tutel_available():
        fail("moe_runtime.use_tutel", True, "needs the optional package `tutel`, which is not installed",
              f"install it ({TUTEL_INSTALL_HINT}) or set moe_runtime.use_tutel to false")


def apply_backend(model: _ModuleT, cfg, zero_stage: int | None = None, world_size: int | None = None,
                  use_data_before_expert_parallel: bool = False) -> _ModuleT:
    """Prepare ``model`` (a :class:`SmeltLM` with reference MoE layers) for ``cfg.moe_runtime.backend``.

    Call it after the process group is initialised and *before* ``deepspeed.initialize``.

    * ``reference``: returns ``model`` unchanged.
    * ``deepspeed``: replaces every ``layers.{i}.mlp`` :class:`MoE` in place by a
      :class:`~smelt_ds.parallel.moe_backends.deepspeed_moe.DeepSpeedMoE` holding this rank's experts
      (``ep_size > 1`` creates DeepSpeed's ``ep_size_{n}`` expert groups now, so the local experts can be
      picked).
    * ``autoep``: the layers are replaced later by ``deepspeed.initialize`` from the
      ``expert_parallel`` section (:func:`smelt_ds.parallel.ds_config.expert_parallel_section`);
      this registers a forward pre-hook on ``model`` that attaches the router hooks
      (:func:`~smelt_ds.parallel.moe_backends.autoep.attach_autoep_hooks`) to the replaced layers on the first
      forward, so the aux and z losses reach ``SmeltLM``'s loss.

    ``world_size`` defaults to ``torch.distributed``'s when initialised. Returns ``model``.
    Raises ConfigError (see :func:`check_backend_runtime`).
    """
    if world_size is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    check_backend_runtime(cfg, zero_stage, world_size)
    if cfg.moe_runtime.backend == "deepspeed":
        convert_to_deepspeed_moe(model, cfg, use_data_before_expert_parallel)
    elif cfg.moe_runtime.backend == "autoep":
        install_autoep_prehook(model)
    return model
