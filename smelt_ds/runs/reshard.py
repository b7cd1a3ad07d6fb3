"""Resume a run at another layout: number of ranks, expert-parallel size, ZeRO stage or MoE backend.

DeepSpeed's own files hold per-rank partitions (ZeRO) and per-expert-parallel-rank experts, so
they load only at the layout that wrote them. A checkpoint written with ``train.layout_free_state``
also holds the whole training state in the reference layout (:mod:`smelt_ds.runs.reference_weights`:
one shard per writing rank, every tensor under its reference name, expert ``i`` of a layer at
index ``i``): fp32 master weights, AdamW's two moments of every parameter, AdamW's step count,
persistent buffers (the aux-loss-free router biases). A resume at another layout builds the
engine of the new layout as a new run would, then writes into every live parameter its master
weights and moments, each expert's going to the rank that owns that expert now
(:mod:`smelt_ds.parallel.optimizer_state`), and restores the rest from rank 0's client state:
the optimizer-step counters and LR schedule position (:func:`engine_counters`), the data
position, the RNG and the step guard.

The batch: the global batch (samples per optimizer step) stays the run's, and the accumulation
is re-derived from it for the new number of ranks and micro-batch size (:func:`plan_resume`; the
micro-batch may change, as Megatron-LM lets it, e.g. to fit GPUs with less memory). Every
optimizer step reads the same samples as the uninterrupted run (the data loader cuts epochs to
the global batch and reads step ``t``'s samples from positions ``[t G, (t + 1) G)`` whatever the
ranks and micro-batches: :class:`smelt_ds.data.loader.TrainLoader`), so the run continues on its
trajectory up to the reduction order of the new layout. With the micro-batch size kept, every
micro-batch holds the same samples too; with another, the terms computed per micro-batch change
with the grouping: the load-balancing loss (``train.aux_loss_coef``, a product of two
per-micro-batch means) and DeepSpeed-MoE's capacity. A global batch the ranks and micro-batches
cannot form is refused, naming the numbers of ranks and the micro-batch sizes that can; another
global batch (``train.global_batch_tokens``) is refused.

Memory: the shards are opened memory-mapped (``torch.load(mmap=True)``) and each parameter's
values are read when it is written, so a rank holds at most one parameter's (or one layer's
local experts') weights and moments beyond its engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smelt_ds.config.train import resolve_batch
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.optimizer_state import MOMENTS, finish_set, prepare_state, set_full_state
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.reference_weights import expert_placement, mark_local_expert_counts, reference_name, shard_path

__all__ = ["LAYOUT_KEYS", "ResumePlan", "engine_counters", "layout_change", "plan_resume", "load_resharded",
           "valid_world_sizes"]

#: what a layout is (the ``COMPLETE`` marker's keys, :func:`smelt_ds.runs.checkpoint.run_layout`)
LAYOUT_KEYS = ("world_size", "zero_stage", "moe_backend", "ep_size")
_WORDS = {"world_size": "ranks", "zero_stage": "ZeRO stage", "moe_backend": "MoE backend", "ep_size": "EP size"}


def layout_change(meta: dict[str, Any], layout: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (in the checkpoint, now)}`` for each :data:`LAYOUT_KEYS` entry that differs (keys an
    older marker lacks are not compared); empty when the layout is the checkpoint's."""
    return {k: (meta[k], layout[k]) for k in LAYOUT_KEYS if k in meta and k in layout and meta[k] != layout[k]}


def valid_world_sizes(global_batch: int, micro_batch: int, ep_size: int, limit: int = 1024) -> list[int]:
    """Numbers of ranks (up to ``limit``) that form a global batch of ``global_batch`` samples from
    micro-batches of ``micro_batch``: divisors of ``global_batch / micro_batch`` that the
    expert-parallel size divides."""
    n = global_batch // micro_batch
    return [w for w in range(1, min(n, limit) + 1) if n % w == 0 and w % ep_size == 0]


def _either(sizes: list[int]) -> str:
    """``"2, 4 or 8"``."""
    words = [str(w) for w in sizes]
    return "another number of" if not words else words[0] if len(words) == 1 else \
        f"{', '.join(words[:-1])} or {words[-1]}"


def _nearest(sizes: list[int], world: int, k: int = 3) -> list[int]:
    return sorted(sorted(sizes, key=lambda w: (abs(w - world), w))[:k])


@dataclass
class ResumePlan:
    """A resume at another layout or micro-batch size (:func:`plan_resume`): the checkpoint's layout
    and batch, the new ones, and the accumulation re-derived for the new number of ranks and
    micro-batch size. ``changes`` (the layout keys that differ) empty: the same layout with another
    micro-batch size, which DeepSpeed's own files load; else the layout-free state is converted."""

    checkpoint: Path
    old: dict[str, Any]
    new: dict[str, Any]
    changes: dict[str, tuple[Any, Any]]
    old_accum: int
    new_accum: int
    converted: list[str] = field(default_factory=lambda: [
        "fp32 weights", "AdamW moments and step", "router biases and other buffers", "LR schedule position",
        "data position", "RNG", "step guard"])

    def _batch(self) -> str:
        a, b = self.old["micro_batch_size"], self.new["micro_batch_size"]
        micro = f"micro-batch {b}" if a == b else f"micro-batch {a} -> {b}"
        return (f"{micro} x accumulation {self.old_accum} -> {self.new_accum} (the run's global batch of "
                f"{self.old['global_batch_samples']} samples kept")

    def console(self) -> str:
        """The console line of the resume."""
        if not self.changes:
            return (f"resuming {self.checkpoint.name} at its layout with another micro-batch size: {self._batch()}, "
                    "and the same samples in every optimizer step; the load-balancing loss and DeepSpeed-MoE's "
                    "capacity are computed per micro-batch, so they now see other groups of samples)")
        what = "; ".join(f"{_WORDS[k]} {a} -> {b}" for k, (a, b) in self.changes.items())
        return (f"resuming {self.checkpoint.name} at another layout ({what}): {ckpt.describe_layout(self.old)} -> "
                f"{ckpt.describe_layout(self.new)}; {self._batch()}); converted from the layout-free state: "
                f"{', '.join(self.converted)}")

    def row(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` row's entry (:meth:`record`)."""
        return {"checkpoint": self.checkpoint.name, "from": {k: self.old.get(k) for k in LAYOUT_KEYS},
                "to": {k: self.new.get(k) for k in LAYOUT_KEYS}, "accumulation": [self.old_accum, self.new_accum],
                "micro_batch_size": [self.old["micro_batch_size"], self.new["micro_batch_size"]],
                "global_batch_samples": self.old["global_batch_samples"],
                "converted": self.converted if self.changes else []}

    def record(self) -> dict[str, Any]:
        """What the run's ``metrics.jsonl`` gets at the resumed step: ``{"layout_change": row}``, or
        ``{"micro_batch_change": row}`` at the writing layout (:meth:`row`)."""
        return {"layout_change" if self.changes else "micro_batch_change": self.row()}


def _marker(path: Path) -> dict[str, Any]:
    return ckpt.read_marker(path)


def _peek(out_dir: Path, resume: str) -> Path | None:
    """The checkpoint a resume will most likely load: for ``auto`` the newest whose marker is sound
    (:func:`smelt_ds.runs.checkpoint.newest_sound`; :func:`smelt_ds.runs.checkpoint.choose` sets the
    damaged ones aside), before the files' digests are checked (a file that does not verify makes
    ``choose`` fall back to an older one of the same run, and the plan is redone for it)."""
    if resume == "none":
        return None
    path = ckpt.newest_sound(out_dir) if resume == "auto" else Path(resume)
    return path if path is not None and (path / ckpt.MARKER).is_file() else None


def _unformable(path: Path, global_batch: int, micro: int, old_micro: int, world_size: int, ep: int) -> str:
    """The message of a resume whose ranks and micro-batches cannot form the run's global batch:
    the numbers of ranks near ``world_size`` that can with micro-batches of ``micro``, the
    micro-batch sizes that can on ``world_size`` ranks, else the ranks that can with the run's."""
    options = []
    near = _nearest(valid_world_sizes(global_batch, micro, ep), world_size) if global_batch % micro == 0 else []
    if near:
        options.append(f"resume on {_either(near)} rank(s) (expert-parallel size {ep})")
    micros = [m for m in range(1, global_batch // world_size + 1) if global_batch % (m * world_size) == 0]
    if micros:
        options.append(f"on {world_size} rank(s) with train.micro_batch_size {_either(_nearest(micros, micro))}")
    if not options:
        runs = _nearest(valid_world_sizes(global_batch, old_micro, ep), world_size)
        options.append(f"resume with the run's train.micro_batch_size {old_micro} on {_either(runs)} rank(s) "
                       f"(expert-parallel size {ep})")
    count = (f"{global_batch // micro} micro-batches per step" if global_batch % micro == 0
             else f"not a whole number of micro-batches of {micro}")
    return (f"{world_size} rank(s) cannot form the run's global batch of {global_batch} samples from micro-batches "
            f"of {micro} ({count}; checkpoint {path}): {', or '.join(options)}")


def plan_resume(cfg, out_dir: Path, resume: str, world_size: int):
    """Before the engine is built: the recipe to build and, for a resume at another layout or
    micro-batch size, its :class:`ResumePlan`: ``(cfg, plan or None)``.

    The new recipe keeps the run's global batch (samples per optimizer step, the checkpoint
    marker's ``global_batch_samples``) and sets ``train.gradient_accumulation_steps`` to
    ``global_batch / (micro_batch x world_size)`` with the recipe's micro-batch size
    (``train.global_batch_tokens``, when set, is the run's and resolves to the same value), at any
    layout: a recipe's explicit accumulation describes the layout it was written for, and a resume
    keeps the run's global batch (the caller says so when the recipe's value is replaced).

    Raises:
        ConfigError: naming the checkpoint and the fix, when the layout differs and the checkpoint
            holds no layout-free state (written before smelt-ds kept it, with
            ``train.layout_free_state: false``, by a save without reference weights, or removed
            by pruning: :func:`smelt_ds.runs.checkpoint.holds`); when ``train.global_batch_tokens``
            differs from the run's global batch; when ``world_size`` ranks and the micro-batch size
            cannot form the run's global batch (naming the nearest numbers of ranks and the
            micro-batch sizes that can); or when the run draws random numbers per micro-batch
            (dropout, router jitter), which another layout or micro-batch size would give to other
            micro-batches.
    """
    path = _peek(out_dir, resume)
    if path is None:
        return cfg, None
    try:
        meta = _marker(path)
    except ConfigError:  # a damaged marker: checkpoint.choose sets the checkpoint aside, and the plan is redone
        return cfg, None
    rt = cfg.moe_runtime  # the layout alone: the recipe's batch may not resolve on world_size ranks (checked below)
    new = {"world_size": world_size, "zero_stage": cfg.deepspeed.zero_stage, "moe_backend": rt.backend,
           "ep_size": rt.ep_size if rt.backend != "reference" else 1}
    changes = layout_change(meta, new)
    what = "; ".join(f"{_WORDS[k]} {a} in the checkpoint vs {b} now" for k, (a, b) in changes.items())
    held = ckpt.holds(meta)
    if changes and held["removed_by"] is not None:
        raise ConfigError(
            f"checkpoint {path} was written with another layout ({what}) and no longer holds its layout-free "
            "training state: its reference shards (fp32 weights and AdamW moments in the reference layout) were "
            f"removed by pruning once the newer {held['removed_by']} was complete (train.reference_weights newest "
            "or minimal keeps them in the newest checkpoint only): resume the run's newest checkpoint at this "
            f"layout (--resume auto), or this one at its own layout ({ckpt.describe_layout(meta)}); "
            "train.reference_weights: every_save keeps them in every checkpoint")
    if "global_batch_samples" not in meta or (changes and not held["layout_free"]):
        if not changes:
            return cfg, None  # written before the batch was recorded: resumed through DeepSpeed as it was
        raise ConfigError(
            f"checkpoint {path} was written with another layout ({what}) and holds no layout-free training state "
            "(it was written before smelt-ds kept one, with train.layout_free_state: false, or by a save without "
            "the reference weights, train.reference_weights): resume it at its own layout "
            f"({ckpt.describe_layout(meta)}), or continue from its weights alone with `smelt-ds export` and "
            "train.init_from in a new --run-dir (the optimizer state starts fresh)")
    t = cfg.train
    old_micro, global_batch = int(meta["micro_batch_size"]), int(meta["global_batch_samples"])
    micro = t.micro_batch_size
    if t.global_batch_tokens is not None and t.global_batch_tokens != global_batch * t.seq_len:
        raise ConfigError(
            f"train.global_batch_tokens {t.global_batch_tokens} differs from the run's global batch of "
            f"{global_batch * t.seq_len} tokens ({global_batch} samples of train.seq_len {t.seq_len}; checkpoint "
            f"{path}): a resume keeps the run's global batch (a micro-batch change keeps it: the accumulation "
            f"adjusts): --set train.global_batch_tokens={global_batch * t.seq_len}, or train with another global "
            "batch as a new run from this one's weights (`smelt-ds export`, then train.init_from in a new --run-dir)")
    ep = new["ep_size"]
    if global_batch % (micro * world_size):
        raise ConfigError(_unformable(path, global_batch, micro, old_micro, world_size, ep))
    accum = global_batch // (micro * world_size)
    if (changes or micro != old_micro) and (cfg.model.dropout > 0 or cfg.moe.router_jitter > 0):
        raise ConfigError(
            f"the run draws random numbers per micro-batch (model.dropout {cfg.model.dropout}, moe.router_jitter "
            f"{cfg.moe.router_jitter}), which another layout or micro-batch size gives to other micro-batches: "
            f"resume checkpoint {path} at its own layout ({ckpt.describe_layout(meta)}) and micro-batch size "
            f"(--set train.micro_batch_size={old_micro})")
    if t.global_batch_tokens is not None:
        resolve_batch(t.model_copy(update={"gradient_accumulation_steps": None}), world_size)  # the run's: same accum
    new_cfg = cfg
    if t.global_batch_tokens is None and (t.gradient_accumulation_steps or 1) != accum:  # else the recipe says it
        new_cfg = cfg.model_copy(update={"train": t.model_copy(update={"gradient_accumulation_steps": accum})})
    if not changes and micro == old_micro:
        return new_cfg, None
    old_accum = global_batch // (old_micro * int(meta["world_size"]))
    return new_cfg, ResumePlan(path, meta, ckpt.run_layout(new_cfg, world_size), changes, old_accum, accum)


def engine_counters(built) -> dict[str, int]:
    """What a resume at another layout restores of the engine and its LR schedule: DeepSpeed's
    ``global_steps``, ``global_samples`` and ``skipped_steps``, and the ``LambdaLR`` position
    (``last_epoch``, ``_step_count``). Saved in every rank's client state."""
    e, s = built.engine, built.scheduler
    return {"global_steps": int(e.global_steps), "global_samples": int(e.global_samples),
            "skipped_steps": int(e.skipped_steps), "lr_last_epoch": int(getattr(s, "last_epoch", 0)),
            "lr_step_count": int(getattr(s, "_step_count", 0))}


class _Shards:
    """The layout-free state of a checkpoint, memory-mapped: one shard per writing rank."""

    def __init__(self, path: Path, world: int):
        self.dense: dict[str, torch.Tensor] = {}
        self.dense_moments: dict[str, dict[str, torch.Tensor]] = {}
        self.experts: dict[str, dict[int, torch.Tensor]] = {}
        self.expert_moments: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        self.adam_step = None
        for r in range(world):
            f = shard_path(path, r)
            try:
                shard = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file: name it
                raise ConfigError(f"the layout-free state {f} is not readable ({type(e).__name__}): resume an earlier "
                                  "checkpoint with --resume checkpoints/stepNNNNNNNN") from None
            opt = shard.get("optimizer")
            if opt is None:
                raise ConfigError(f"{f} holds the weights but not the optimizer state: the checkpoint cannot resume at "
                                  "another layout; resume it at its own layout")
            self.dense.update(shard["dense"])
            self.dense_moments.update(opt["dense"])
            for name, by in shard["experts"].items():
                self.experts.setdefault(name, {}).update(by)
            for name, by in opt["experts"].items():
                self.expert_moments.setdefault(name, {}).update(by)
            if shard["dense"] or shard["experts"]:
                self.adam_step = opt["adam_step"] if self.adam_step is None else self.adam_step

    def _expert(self, ref: str, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s weight and moments of expert tensor ``ref`` (``[2F, H]`` or ``[H, F]``),
        whether the writer held it per expert (an expert-parallel backend) or whole (``reference``)."""
        if ref in self.experts:
            return {"weight": self.experts[ref][e], **self.expert_moments.get(ref, {}).get(e, {})}
        if ref in self.dense:
            return {"weight": self.dense[ref][e], **{m: v[e] for m, v in self.dense_moments.get(ref, {}).items()}}
        raise ConfigError(f"the layout-free state has no tensor {ref}: the checkpoint is from another model")

    def values(self, ref: str, experts: list[int] | None, part: str | None) -> dict[str, torch.Tensor]:
        """``{"weight", "exp_avg", "exp_avg_sq"}`` of a live tensor: a dense one (``experts`` None),
        or the ``part`` (gate, up, down) of the given experts, stacked ``[len(experts), ...]``."""
        if experts is None:
            if ref in self.dense:
                return {"weight": self.dense[ref], **self.dense_moments.get(ref, {})}
            if ref in self.experts:  # a whole [E, ...] expert tensor (reference backend) from per-expert pieces
                n = len(self.experts[ref])
                return self.values(ref, list(range(n)), "whole")
            raise ConfigError(f"the layout-free state has no tensor {ref}: the checkpoint is from another model")
        out: dict[str, list[torch.Tensor]] = {}
        for e in experts:
            for k, v in self._expert(ref, e).items():
                half = v.shape[0] // 2
                piece = v[:half] if part == "gate" else v[half:] if part == "up" else v
                out.setdefault(k, []).append(piece)
        return {k: torch.stack(v) for k, v in out.items()}


def load_resharded(built, path: Path, backend: str) -> dict[str, Any]:
    """Load checkpoint ``path``'s layout-free state into ``built.engine`` (any layout; collective:
    every rank, the same parameter order) and return the client state to continue from (rank 0's:
    the data position, RNG and step guard are the same on every rank of a run).

    Raises ConfigError naming the file for a missing or unreadable shard or a state that does not
    fit the model."""
    meta = _marker(path)
    shards = _Shards(path, int(meta["world_size"]))
    engine = built.engine
    module = engine.module
    if backend == "deepspeed":
        mark_local_expert_counts(module)
    prepare_state(engine, int(shards.adam_step or 0))
    seen: set[int] = set()
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        ref, part, local = reference_name(name, backend)
        ids = None if part is None else expert_placement(t, backend, local)
        values = shards.values(ref, ids, part)
        if part is not None and local is not None:  # DeepSpeed-MoE: one expert per module
            values = {k: v[0] for k, v in values.items()}
        if not isinstance(t, torch.nn.Parameter):
            with torch.no_grad():
                t.copy_(values["weight"].to(t.dtype).view_as(t))
            continue
        for m in MOMENTS:
            values.setdefault(m, torch.zeros_like(values["weight"]))
        set_full_state(engine, t, values)
    finish_set(engine)
    client = torch.load(path / "client_rank0.pt", weights_only=False)
    counters = client.get("counters") or {}
    engine.global_steps = counters.get("global_steps", client["step"])
    engine.global_samples = counters.get("global_samples", 0)
    engine.skipped_steps = counters.get("skipped_steps", 0)
    if built.scheduler is not None and "lr_last_epoch" in counters:
        built.scheduler.last_epoch = counters["lr_last_epoch"]
        built.scheduler._step_count = counters["lr_step_count"]
    return client
