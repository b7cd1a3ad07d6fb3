"""``train.compile``: torch.compile of a SmeltLM under DeepSpeed, per unique layer or whole.

``layers`` (regional compilation, as torchtitan compiles per transformer block): every unique
layer's pure visit function (:meth:`smelt_ds.model.lm.Block.compute`) is compiled with
``fullgraph=True``. The looping block manager keeps the visit's identity (KV-cache slot,
statistics key, recompute flag) outside the compiled code, and parameters are graph inputs, so
one artifact serves every visit and every layer of the same structure: the number of
compilations depends on the layer kinds (dense, MoE) and on the call modes (grad / no grad,
counting tokens or recomputing), never on the number of visits, layers or steps. The output
head (final norm, logits, cross-entropy: :meth:`smelt_ds.model.lm.SmeltLM.head`) is compiled as
one more region. Activation
checkpointing (``torch`` and ``deepspeed`` impls) wraps the compiled call: the recompute runs the
same compiled code. A backend's MoE layer (DeepSpeed-MoE, AutoEP: all-to-all collectives, capacity
bookkeeping) stays eager and only the attention half around it is compiled, as DeepSpeed's own
``compile.autoep_non_moe``. Under ZeRO-3 the regions are compiled with ``fullgraph=False``: the
graph breaks where DeepSpeed's parameter hooks run (they are ``torch.compiler.disable``'d; one
per submodule) and the pieces between are compiled, still once. Making the layers ZeRO-3 leaf
modules (gathered in one hook outside the graph) would avoid the breaks but is wrong for looped
layers: DeepSpeed then reduces a leaf's gradients once per visit (its ZeRO-3 bucket assertion
fails on the second visit).

``model``: the whole forward through DeepSpeed's :meth:`DeepSpeedEngine.compile` (torch.compile
of the engine's module). Supported with the reference backend at ZeRO 0-2 without DeepSpeed's
activation checkpointing; :func:`smelt_ds.config.run.check_run_config` refuses the rest at load time.
"""

from __future__ import annotations

from typing import Any

import torch

from smelt_ds.config.run import RunConfig
from smelt_ds.model.lm import Block, SmeltLM

__all__ = ["compile_layers", "compile_engine", "compile_counters"]


def compile_layers(model: torch.nn.Module, cfg: RunConfig) -> int:
    """Apply ``train.compile: layers`` to ``model`` (a SmeltLM, after its MoE backend, before
    ``deepspeed.initialize``); returns the number of unique layers compiled (0 unless ``layers``).

    Compilation is lazy: the first visit of each layer structure traces (after DeepSpeed
    registered its hooks and a backend replaced the MoE layers). Under ZeRO-3 the graph may break
    at DeepSpeed's hooks (see the module docstring).
    """
    if cfg.train.compile != "layers":
        return 0
    layers = [m for m in model.modules() if isinstance(m, Block)]
    zero3 = cfg.deepspeed.zero_stage == 3
    for layer in layers:
        layer.compile_layer(backend=cfg.train.compile_backend, fullgraph=not zero3)
    for m in model.modules():
        if isinstance(m, SmeltLM):
            m.compile_head(backend=cfg.train.compile_backend, fullgraph=not zero3)
    return len(layers)


def compile_engine(engine: Any, cfg: RunConfig) -> bool:
    """Apply ``train.compile: model``: ``engine.compile(backend=train.compile_backend)``
    (DeepSpeed's own path: torch.compile of the engine's module). Returns whether it compiled."""
    if cfg.train.compile != "model":
        return False
    engine.compile(backend=cfg.train.compile_backend)
    return True


def compile_counters() -> dict[str, int]:
    """torch.compile's process-wide counts: ``unique_graphs`` (graphs compiled) and ``graph_breaks``
    (breaks recorded), from ``torch._dynamo.utils.counters``.
    A looped model compiled per layer must not see them grow with visits or steps."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}
