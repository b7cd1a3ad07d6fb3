"""Reference-layout fp32 weights of a live DeepSpeed engine, for every MoE backend and ZeRO stage.

A checkpoint carries, next to DeepSpeed's own files, the model's weights in the reference layout
(the parameter names and shapes of :class:`smelt_ds.model.SmeltLM` with the reference MoE
backend), split into one shard per rank (which checkpoints: ``train.reference_weights``,
:func:`smelt_ds.runs.checkpoint.writes_reference`)::

    step00000050/reference/rank00000.pt   {"format", "rank", "dense": {name: tensor},
                                           "experts": {name: {expert_index: tensor}}}

They are gathered on the live engine at save time rather than reconstructed from DeepSpeed's files
afterwards, because DeepSpeed 0.19.8's offline tool ``zero_to_fp32`` reads neither the per-expert
files both expert-parallel backends write (``ValueError ... is not a model state checkpoint``) nor
AutoEP at ZeRO-3 (``NotImplementedError``). The live engine knows its partitioning: DeepSpeed's
``deepspeed.utils.safe_get_full_fp32_param`` returns the full fp32 master copy of any parameter
at ZeRO 1-3 (and of the bf16 optimizer), so one code path serves every stage; at ZeRO-0 in fp32
the parameter itself is the master copy.

Who writes what: global rank 0 writes every data-parallel-replicated tensor (attention, norms,
routers, dense and shared-expert FFNs, embeddings, persistent buffers); for expert-sharded
tensors, rank 0 of each expert-data-parallel group writes its expert-parallel rank's experts
under their *global* expert indices (``deepspeed``: ``ep_rank * E / ep_size + j``; ``autoep``: the
placement AutoEP records on each expert parameter). Expert ``i`` of layer ``l`` lands at index
``i`` of layer ``l``'s ``gate_up_proj [E, 2F, H]`` (gate rows first, then up rows, as in
transformers' Qwen3-MoE) and ``down_proj [E, H, F]``. Cost: 4 bytes per parameter per checkpoint
that carries them, 12 when they also hold AdamW's moments (``train.layout_free_state``; DeepSpeed's
own bf16 + AdamW files take 14: docs/checkpoint_cost.md).

:func:`merge_reference_shards` (used by ``smelt-ds export``; :func:`merge_shards` for shards held
in memory, as the in-loop harness evaluation gathers them) checks that the shards are complete:
one per rank of the run, every tensor of the reference model exactly once with its shape, every
expert index of every layer exactly once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from smelt_ds.errors import ConfigError
from smelt_ds.model import SmeltLM
from smelt_ds.parallel.optimizer_state import MOMENTS, adam_step, full_state

__all__ = ["REFERENCE_DIR", "FORMAT", "gather_reference_shard", "shard_path", "merge_reference_shards",
           "merge_shards", "reference_name", "has_reference_shards"]

REFERENCE_DIR = "reference"
FORMAT = 2  # 2: the shards may also hold AdamW's moments and step ("optimizer"), the layout-free training state
_READABLE = (1, 2)

_LAYER = r"(layers\.\d+\.mlp)"
# (pattern on the live module's state-dict name, reference name, expert part); part None = dense
_DEEPSPEED = [
    (re.compile(_LAYER + r"\.moe\.deepspeed_moe\.gate\.wg\.weight"), r"\1.gate.weight", None),
    (re.compile(_LAYER + r"\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.gate_proj\.weight"),
     r"\1.experts.gate_up_proj", "gate"),
    (re.compile(_LAYER + r"\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.up_proj\.weight"),
     r"\1.experts.gate_up_proj", "up"),
    (re.compile(_LAYER + r"\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.down_proj\.weight"),
     r"\1.experts.down_proj", "down"),
]
_AUTOEP = [
    (re.compile(_LAYER + r"\.router\.gate\.weight"), r"\1.gate.weight", None),
    (re.compile(_LAYER + r"\.shared_experts\.(.+)"), r"\1.shared_expert.\2", None),
    (re.compile(_LAYER + r"\.shared_experts_gate\.(.+)"), r"\1.shared_expert_gate.\2", None),
    (re.compile(_LAYER + r"\.experts\.w1"), r"\1.experts.gate_up_proj", "gate"),
    (re.compile(_LAYER + r"\.experts\.w3"), r"\1.experts.gate_up_proj", "up"),
    (re.compile(_LAYER + r"\.experts\.w2"), r"\1.experts.down_proj", "down"),
]


def reference_name(name: str, backend: str) -> tuple[str, str | None, int | None]:
    """Map a live module's state-dict ``name`` to ``(reference_name, part, local_index)``.

    ``part`` is None for dense tensors, else ``gate``/``up``/``down`` (a piece of an expert
    tensor); ``local_index`` is the expert's index among this rank's experts for the ``deepspeed``
    backend (one module per expert) and None for ``autoep`` (one ``[E_local, ...]`` tensor).
    Names that no rule matches are returned unchanged as dense tensors (the reference layout)."""
    rules = {"deepspeed": _DEEPSPEED, "autoep": _AUTOEP}.get(backend, [])
    for pattern, repl, part in rules:
        m = pattern.fullmatch(name)
        if m:
            local = int(m.group(2)) if backend == "deepspeed" and part is not None else None
            return m.expand(repl), part, local
    return name, None, None


def shard_path(ckpt_dir: str | Path, rank: int) -> Path:
    return Path(ckpt_dir) / REFERENCE_DIR / f"rank{rank:05d}.pt"


def has_reference_shards(ckpt_dir: str | Path) -> bool:
    return (Path(ckpt_dir) / REFERENCE_DIR).is_dir()


def _full_fp32(t: torch.Tensor) -> torch.Tensor:
    """The full fp32 value of a parameter or buffer on this rank (collective at ZeRO 1-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(t) if isinstance(t, torch.nn.Parameter) else None
    if full is None:
        if getattr(t, "ds_id", None) is not None:  # ZeRO-3 parameter outside the optimizer
            import deepspeed

            with deepspeed.zero.GatheredParameters([t]):
                return t.detach().float().cpu().clone()
        return t.detach().float().cpu().clone()
    return full.detach().float().cpu().clone()


def expert_placement(t: torch.Tensor, backend: str, local: int | None) -> list[int]:
    """Global expert indices (one per row of dim 0, in order) of the experts this rank holds in ``t``.

    Args:
        t: an expert parameter of ``backend``: DeepSpeed-MoE's holds one expert (its index among the
            layer's local experts is ``local``); AutoEP's stacks its local experts on dim 0.
        backend: ``deepspeed`` or ``autoep`` (``moe_runtime.backend``).
        local: DeepSpeed-MoE only: the expert's index among this rank's local experts (None for AutoEP).

    DeepSpeed-MoE expert ``i`` of expert-parallel rank ``r`` is global expert ``r * n_local + i``
    (``deepspeed.moe.experts``); AutoEP records the global indices in the parameter's
    universal-checkpoint metadata. DeepSpeed-MoE parameters need :func:`mark_local_expert_counts` first.
    """
    from deepspeed.utils import groups

    if backend == "deepspeed":
        ep_rank = groups._get_expert_parallel_rank(t.group_name)  # type: ignore[attr-defined]
        n_local = getattr(t, "_smelt_local_experts", None)
        return [ep_rank * n_local + local]
    from deepspeed.module_inject.auto_ep_layer import AUTOEP_PARAM_LOCAL_EXPERTS, DS_AUTOEP_UC_META

    return list(getattr(t, DS_AUTOEP_UC_META)[AUTOEP_PARAM_LOCAL_EXPERTS])


def _expert_data_rank(t: torch.Tensor) -> int:
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_rank(t.group_name)  # type: ignore[attr-defined]


def mark_local_expert_counts(module: torch.nn.Module) -> None:
    """Give each DeepSpeed-MoE expert parameter of ``module`` its layer's number of local experts
    (attribute ``_smelt_local_experts``), which :func:`expert_placement` needs. AutoEP and the
    reference backend are left alone."""
    for m in module.modules():
        experts = getattr(getattr(m, "deepspeed_moe", None), "experts", None)
        local = getattr(experts, "deepspeed_experts", None)
        if local is None:
            continue
        for p in local.parameters():
            p._smelt_local_experts = len(local)


def gather_reference_shard(engine, backend: str, optimizer: bool = False) -> dict[str, Any]:
    """This rank's shard of the reference-layout fp32 weights (collective: every rank calls it).

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` around a :class:`SmeltLM` (any ZeRO stage).
        backend: ``moe_runtime.backend`` of the run (``reference``, ``deepspeed`` or ``autoep``).
        optimizer: also gather AdamW's moments of every parameter, in the same layout
            (:mod:`smelt_ds.parallel.optimizer_state`): with the weights, the layout-free
            training state a resume at another layout loads (:mod:`smelt_ds.runs.reshard`).

    Returns:
        ``{"format", "rank", "dense": {name: (shape) fp32 CPU tensor}, "experts": {name:
        {global_expert_index: tensor}}, "optimizer": None or {"dense": {name: {moment: tensor}},
        "experts": {name: {global_expert_index: {moment: tensor}}}, "adam_step": int}}``:
        ``dense`` only on global rank 0; ``experts`` only on rank 0 of each expert-data-parallel
        group (expert pieces of ``gate_up_proj`` are whole ``[2F, H]`` rows per expert, of
        ``down_proj`` ``[H, F]``); moments have their weight's shape (buffers have none). The
        weights are the fp32 master copy (at ZeRO-0 with bf16, the optimizer's fp32 copy when
        ``optimizer``).
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    module = engine.module
    if backend == "deepspeed":
        mark_local_expert_counts(module)
    dense: dict[str, dict[str, torch.Tensor]] = {}
    pieces: dict[tuple[str, int], dict[str, dict[str, torch.Tensor]]] = {}
    seen: dict[int, str] = {}
    step, relink = None, True
    # the state dict's order is the same on every rank, so the collective gathers line up
    for name, t in module.state_dict(keep_vars=True).items():
        ref, part, local = reference_name(name, backend)
        if id(t) in seen and part is None:  # a tied or aliased tensor: gather once
            if rank == 0:
                dense[ref] = dense[seen[id(t)]]
            continue
        seen[id(t)] = ref
        if optimizer and isinstance(t, torch.nn.Parameter):
            values = {k: v for k, v in full_state(engine, t, relink=relink).items() if v is not None}
            relink = False
            step = adam_step(engine, t) if step is None else step
        else:
            values = {"weight": _full_fp32(t)}
        if part is None:
            if rank == 0:
                dense[ref] = values
            continue
        if _expert_data_rank(t) != 0:
            continue
        for kind, full in values.items():
            rows = full if local is None else full[None]
            for e, row in zip(expert_placement(t, backend, local), rows, strict=True):
                pieces.setdefault((ref, e), {}).setdefault(kind, {})[part] = row
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for (ref, e), by_kind in pieces.items():
        experts.setdefault(ref, {})[e] = {
            kind: parts["down"] if "down" in parts else torch.cat([parts["gate"], parts["up"]], dim=0)
            for kind, parts in by_kind.items()}
    shard: dict[str, Any] = {"format": FORMAT, "rank": rank,
                             "dense": {n: v["weight"] for n, v in dense.items()},
                             "experts": {n: {e: v["weight"] for e, v in by.items()} for n, by in experts.items()},
                             "optimizer": None}
    if optimizer:
        shard["optimizer"] = {
            "dense": {n: {m: v[m] for m in MOMENTS if m in v} for n, v in dense.items() if MOMENTS[0] in v},
            "experts": {n: {e: {m: v[m] for m in MOMENTS if m in v} for e, v in by.items() if MOMENTS[0] in v}
                        for n, by in experts.items()},
            "adam_step": step or 0}
    return shard


def _expected_state(cfg) -> dict[str, torch.Size]:
    """Names and shapes of the reference model's state dict, built on the meta device."""

    with torch.device("meta"):  # the model takes its architecture only: the reference layout
        model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    return {k: v.shape for k, v in model.state_dict().items()}


def _load_shard(path: Path) -> dict[str, Any]:
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise ConfigError(f"reference weights {path} are not readable ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}): the checkpoint is damaged; "
                          "export an earlier checkpoint (checkpoints/stepNNNNNNNN)") from None
    if not isinstance(shard, dict) or shard.get("format") not in _READABLE:
        raise ConfigError(f"{path} is not a smelt-ds reference-weights shard of format {FORMAT}")
    return shard


def merge_reference_shards(ckpt_dir: str | Path, cfg, world_size: int) -> dict[str, torch.Tensor]:
    """The reference-layout fp32 state dict of a checkpoint, merged from its per-rank shards.

    Args:
        ckpt_dir: a checkpoint directory (``checkpoints/stepNNNNNNNN``).
        cfg: the run's :class:`smelt_ds.config.run.RunConfig` (the expected names and shapes).
        world_size: ranks that wrote the checkpoint (one shard each).

    Returns:
        ``{name: tensor}`` with exactly the keys of the reference :class:`SmeltLM`'s state dict.

    Raises:
        ConfigError: naming the file or tensor, for a missing or unreadable shard, a tensor
            missing or written twice, a wrong shape, or a missing or duplicated expert index.
    """
    ckpt_dir = Path(ckpt_dir)
    shards, labels = [], []
    for r in range(world_size):
        path = shard_path(ckpt_dir, r)
        if not path.is_file():
            raise ConfigError(f"{ckpt_dir}: reference weights of rank {r} are missing ({path}); the checkpoint "
                              f"was written by {world_size} ranks: export an earlier, complete checkpoint")
        shards.append(_load_shard(path))
        labels.append(str(path))
    return merge_shards(shards, cfg, ckpt_dir, labels)


def merge_shards(shards: Sequence[dict[str, Any]], cfg, where: str | Path,
                 labels: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Merge the shards of every rank (:func:`gather_reference_shard`'s output, in memory) into the
    reference-layout fp32 state dict, checked for completeness.

    Args:
        shards: one shard per rank, in rank order: ``{"format", "rank", "dense": {name: tensor},
            "experts": {name: {global_expert_index: tensor}}}``.
        cfg: the run's :class:`smelt_ds.config.run.RunConfig` (the expected names and shapes).
        where: what the shards are (a checkpoint directory, "the live engine"), for messages.
        labels: a name per shard for messages (its file); default ``"<where> rank r"``.

    Returns:
        ``{name: tensor}`` with exactly the keys of the reference :class:`SmeltLM`'s state dict;
        expert tensors stacked over the expert index: ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``.

    Raises:
        ConfigError: a shard of another format, a tensor missing or written twice, a wrong shape,
            or a missing or duplicated expert index.
    """
    expected = _expected_state(cfg)
    labels = list(labels) if labels is not None else [f"{where} rank {r}" for r in range(len(shards))]
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for label, shard in zip(labels, shards, strict=True):
        if not isinstance(shard, dict) or shard.get("format") not in _READABLE:
            raise ConfigError(f"{label} is not a smelt-ds reference-weights shard of format {FORMAT}")
        for name, t in shard["dense"].items():
            if name in state:
                raise ConfigError(f"{label}: tensor {name} was already written by another rank")
            state[name] = t
        for name, by_index in shard["experts"].items():
            into = experts.setdefault(name, {})
            for e, t in by_index.items():
                if e in into:
                    raise ConfigError(f"{label}: expert {e} of {name} was already written by another rank "
                                      "(two expert-parallel ranks claim the same expert)")
                into[e] = t
    for name, by_index in experts.items():
        n = expected[name][0] if name in expected else len(by_index)
        missing = sorted(set(range(n)) - set(by_index))
        if missing or set(by_index) - set(range(n)):
            raise ConfigError(f"{where}: {name} has experts {sorted(by_index)} of 0..{n - 1} (missing "
                              f"{missing[:8]}): a rank's shard is incomplete; export an earlier checkpoint")
        state[name] = torch.stack([by_index[e] for e in range(n)])
    _check_against(state, expected, where)
    return state


def _check_against(state: dict[str, torch.Tensor], expected: dict[str, torch.Size], where: str | Path) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(s)}" for k, s in expected.items()
             if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        raise ConfigError(f"{where}: the reference weights do not fit the run's recipe (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}, shape written vs recipe {wrong[:3]})")
