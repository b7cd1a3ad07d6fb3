"""Optimizer parameter groups for the MoE backends: expert parameters in DeepSpeed's ``moe`` groups
(ZeRO-1/2 refuse an MoE model whose optimizer has none), and the optimizer factory
:class:`moe_optimizer` that splits them after AutoEP has replaced the layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["split_params_into_moe_groups", "moe_optimizer", "optimizer_param_groups"]


def split_params_into_moe_groups(param_groups: Iterable[dict[str, Any]] | dict[str, Any] | Iterable[nn.Parameter]
                                 ) -> list[dict[str, Any]]:
    """DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` made safe for our groups.

    Every group gets a ``name`` if it has none (DeepSpeed indexes by it); expert parameters
    (``param.allreduce is False``) move into copies of their group with ``moe: True`` and
    ``name: "ep_size_{n}"`` (all other keys, e.g. ``lr_scale`` and ``weight_decay``, are kept);
    empty groups are dropped. ZeRO-1/2 refuse MoE models whose optimizer has no ``moe`` group
    (``AssertionError: The model has moe layers, but None of the param groups are marked as MoE``).
    """
    groups: list[Any] = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    if groups and not isinstance(groups[0], dict):  # a plain iterable of parameters
        groups = [{"params": groups}]
    groups = [{**g, "params": list(g["params"]), "name": g.get("name", f"group{i}")} for i, g in enumerate(groups)]
    if any(g.get("moe") for g in groups):
        return groups
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    out = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in out if g["params"]]


class moe_optimizer:  # noqa: N801 - used like a function: optimizer=moe_optimizer(AdamW, lr=...)
    """A client optimizer *factory* for ``deepspeed.initialize(optimizer=..., model_parameters=groups)``.

    DeepSpeed calls it with ``model_parameters`` after AutoEP has replaced the MoE layers (and
    remapped the groups to the new parameters); it splits expert parameters into ``moe`` groups
    (:func:`split_params_into_moe_groups`) and builds ``optimizer_cls(groups, **kwargs)``. Works
    for every backend and ZeRO stage; for the reference backend the split is a no-op.
    """

    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs

    def __call__(self, param_groups) -> torch.optim.Optimizer:
        return self.optimizer_cls(split_params_into_moe_groups(param_groups), **self.kwargs)


def optimizer_param_groups(model: nn.Module, param_groups: list[dict[str, Any]], cfg) -> list[dict[str, Any]]:
    """Optimizer parameter groups for ``cfg.moe_runtime.backend``; call after :func:`apply_backend`.

    * ``reference`` / ``autoep``: ``param_groups`` unchanged. (AutoEP's expert parameters do not
      exist before ``deepspeed.initialize``; DeepSpeed remaps a client optimizer's groups to the
      replaced parameters and, for a DeepSpeed-config optimizer, splits MoE groups itself.)
    * ``deepspeed``: :func:`split_params_into_moe_groups`.
    """
    if cfg.moe_runtime.backend == "deepspeed":
        return split_params_into_moe_groups(param_groups)
    return param_groups
