"""The ``autoep`` MoE backend: DeepSpeed AutoEP replaces each ``layers.{i}.mlp`` inside
``deepspeed.initialize`` (the ``expert_parallel`` section of the DeepSpeed config,
:func:`smelt_ds.parallel.ds_config.expert_parallel_section`); this module gives the replaced
layers the reference MoE's ``last_route`` / ``last_losses`` through forward hooks, attached on the
model's first forward (:func:`install_autoep_prehook`).

Shape legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from smelt_ds.model.losses import load_balancing_loss, router_z_loss
from smelt_ds.model.router import RouterOutput
from smelt_ds.parallel.moe_backends.expert_parallel import moe_blocks

__all__ = ["install_autoep_prehook", "autoep_layers", "attach_autoep_hooks"]


def install_autoep_prehook(model: nn.Module) -> None:
    """Register (once) a forward pre-hook on ``model`` that attaches the router hooks
    (:func:`attach_autoep_hooks`) to the AutoEP layers ``deepspeed.initialize`` put in place."""
    if getattr(model, "_smelt_autoep_prehook", False):
        return
    model.register_forward_pre_hook(_autoep_prehook)
    cast(Any, model)._smelt_autoep_prehook = True


def autoep_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, AutoEPMoELayer)`` pairs of ``model`` (empty before ``deepspeed.initialize``)."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [(f"{name}.mlp", block.mlp) for name, block in moe_blocks(model)
            if isinstance(block.mlp, AutoEPMoELayer)]


def attach_autoep_hooks(model: nn.Module) -> int:
    """Give every AutoEP layer of ``model`` the reference MoE's ``last_route`` / ``last_losses``.

    AutoEP's layer returns only the output tensor (our modules have no HF ``_can_record_outputs``,
    so ``return_router_logits`` is off). Forward hooks on ``layer.router.gate`` (logits ``(T, E)``)
    and ``layer.router`` (``(top_scores, selected_experts, counts)``) capture the routing, and a
    hook on the layer computes ``aux``/``z`` exactly as the reference MoE does, so
    ``SmeltLM`` reports ``mean_visits(aux)`` / ``mean_visits(z)`` (weighted by the training objective) the same
    way for every backend. Idempotent; returns the number of layers newly hooked.
    """
    n = 0
    layer: Any  # AutoEPMoELayer, given the attributes below
    for _, layer in autoep_layers(model):
        if getattr(layer, "_smelt_hooked", False):
            continue
        layer.last_route, layer.last_losses, layer._smelt_capture = None, {}, {}
        layer.router.gate.register_forward_hook(_capture_logits_hook(layer))
        layer.router.register_forward_hook(_capture_route_hook(layer))
        layer.register_forward_hook(_finish_route_hook)
        layer._smelt_hooked = True
        n += 1
    return n


def _autoep_prehook(model: nn.Module, args) -> None:
    attach_autoep_hooks(model)  # returns nothing: a forward pre-hook's return value replaces the inputs


def _capture_logits_hook(layer: Any):
    def hook(module, args, logits_TE):
        layer._smelt_capture["logits_TE"] = logits_TE

    return hook


def _capture_route_hook(layer: Any):
    def hook(module, args, out):
        layer._smelt_capture["top_scores_TK"], layer._smelt_capture["selected_TK"] = out[0], out[1]

    return hook


def _finish_route_hook(layer: Any, args, output) -> None:
    cap = layer._smelt_capture
    logits_TE = cap.pop("logits_TE").float()
    if layer.router.score_func == "softmax":
        probs_TE = logits_TE.softmax(dim=-1)
    else:
        scores_TE = logits_TE.sigmoid()
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    idx_TK = cap.pop("selected_TK")
    route = RouterOutput(logits_TE, probs_TE, idx_TK, cap.pop("top_scores_TK"))
    layer.last_route = route
    layer.last_losses = {"aux": load_balancing_loss(probs_TE, idx_TK), "z": router_z_loss(logits_TE)}
