"""``smelt-ds checkpoint info RUN_OR_CKPT``: what a checkpoint holds and where it can resume.

Reads the ``COMPLETE`` marker and the files' sizes only (``--verify`` also checks every file's
SHA-256), so it runs on a login or CPU node in one process whatever the checkpoint's size: memory
is the marker's, not the model's.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from smelt_ds.config.loading import config_from_dict, config_to_dict, load_config
from smelt_ds.errors import ConfigError
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.reshard import valid_world_sizes

__all__ = ["add_parser", "resumable_layouts", "checkpoint_info"]

_BACKEND_STAGES = {"reference": (0, 1, 2, 3), "deepspeed": (0, 1, 2), "autoep": (0, 1, 2, 3)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``checkpoint`` (sub-command ``info``)."""
    p = sub.add_parser("checkpoint", help="what a checkpoint holds (step, layout, files, completeness) and the "
                                          "layouts it can resume at")
    inner = p.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND", required=True)
    i = inner.add_parser("info", help="step, layout, files and sizes, completeness, resumable layouts",
                         description="Print a checkpoint's step, the layout that wrote it, its files and sizes, "
                                     "whether it is complete, and the layouts (ranks, MoE backend, expert-parallel "
                                     "size, ZeRO stage) a resume (`smelt-ds train RECIPE --resume auto`) can "
                                     "continue it at with the run's recipe. Given a run directory, it reports the "
                                     "checkpoint --resume auto loads and names each newer one resume sets aside, "
                                     "with why. Exit status 1 for an incomplete or damaged checkpoint: a marker "
                                     "that is not one or does not list every file its layout needs, a listed file "
                                     "missing, or (--verify) a file whose SHA-256 differs; for a run directory, "
                                     "when no checkpoint of it is sound.",
                         epilog="example: smelt-ds checkpoint info runs/tiny-smelt")
    i.add_argument("path", help="run directory (the checkpoint --resume auto loads: its newest complete one that is "
                                "not damaged) or a checkpoints/stepNNNNNNNN directory (that one, damaged or not)")
    i.add_argument("--recipe", default=None, help="recipe to check the layouts against (default: the run's "
                                                  "config.yaml)")
    i.add_argument("--max-ranks", type=int, default=64, help="largest number of ranks to list (default 64)")
    i.add_argument("--verify", action="store_true", help="also check every file's SHA-256 against the marker")
    i.set_defaults(func=run_info)


def _checkpoint_of(path: Path, verify: bool) -> tuple[Path, list[tuple[Path, list[str]]]]:
    """The checkpoint to report, and the newer ones ``--resume auto`` sets aside with their problems
    (:func:`smelt_ds.runs.checkpoint.auto_choice`): a step directory is itself; a run directory
    gives the checkpoint resume loads, or its newest damaged one when none is sound."""
    if (path / ckpt.MARKER).exists() or path.name.startswith("step"):
        return path, []
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist: pass a run directory or a checkpoints/stepNNNNNNNN directory")
    chosen, aside = ckpt.auto_choice(path, sha256=verify)
    if chosen is not None:
        return chosen, aside
    if aside:
        return aside[0][0], []  # none is sound: the newest, reported as damaged
    raise ConfigError(f"run directory {path} holds no complete checkpoint (checkpoints/step*/{ckpt.MARKER})")


def resumable_layouts(cfg, meta: dict[str, Any], max_ranks: int = 64) -> list[dict[str, Any]]:
    """The layouts recipe ``cfg`` can resume a checkpoint with marker ``meta`` at: ``[{"world_size",
    "moe_backend", "ep_size", "zero_stages"}]``, each checked as training checks a recipe (the
    recipe with that backend, EP size and ZeRO stage must load). Only the writing layout when the
    checkpoint has no layout-free state (:func:`smelt_ds.runs.checkpoint.holds`: never written, or
    removed by pruning)."""
    if not ckpt.holds(meta)["layout_free"] or "global_batch_samples" not in meta:
        return [{"world_size": meta["world_size"], "moe_backend": meta.get("moe_backend", "reference"),
                 "ep_size": meta.get("ep_size", 1), "zero_stages": [meta.get("zero_stage")]}]
    raw = config_to_dict(cfg)
    experts = cfg.moe.num_experts
    out = []
    for world in valid_world_sizes(int(meta["global_batch_samples"]), int(meta["micro_batch_size"]), 1, max_ranks):
        for backend, stages in _BACKEND_STAGES.items():
            for ep in ([1] if backend == "reference" else [e for e in range(1, world + 1)
                                                           if world % e == 0 and experts % e == 0]):
                ok = []
                for zero in stages:
                    candidate = {**raw, "moe_runtime": {**raw.get("moe_runtime", {}), "backend": backend,
                                                        **({"ep_size": ep} if backend != "reference" else {})},
                                 "deepspeed": {**raw.get("deepspeed", {}), "zero_stage": zero}}
                    if backend == "reference":
                        candidate["moe_runtime"].pop("ep_size", None)
                    try:
                        config_from_dict(candidate, source="<layout>")
                    except ConfigError:
                        continue
                    ok.append(zero)
                if ok:
                    out.append({"world_size": world, "moe_backend": backend, "ep_size": ep, "zero_stages": ok})
    return out


def checkpoint_info(path: Path, recipe: str | None = None, max_ranks: int = 64,
                    verify: bool = False) -> tuple[str, int]:
    """The report :func:`run_info` prints, and the exit status: 0 complete, 1 incomplete or damaged.

    ``path``: a step directory (reported as it is), or a run directory: the checkpoint ``--resume
    auto`` loads (:func:`smelt_ds.runs.checkpoint.auto_choice`, ``verify`` checking the SHA-256s as
    resume does), each newer one resume sets aside named with why; its newest damaged one when
    none is sound. Raises ConfigError for a path that does not exist or a run without checkpoints.

    Damaged: the marker does not read as one (:func:`smelt_ds.runs.checkpoint.read_marker`), does not
    list every file its layout needs (:func:`smelt_ds.runs.checkpoint.layout_gaps`), lists a file that
    is missing, or (``verify``) a file differs from its SHA-256; the report then says why, claims no
    layout-free state and lists no layout to resume at."""
    ck, aside = _checkpoint_of(path, verify)
    lines = [f"checkpoint    {ck}" + (" (the one --resume auto loads)" if aside else "")]
    for newer, why in aside:
        lines.append(f"set aside     {newer.name}, newer, is damaged: {'; '.join(why[:2])}; --resume auto moves it to "
                     f"checkpoints/damaged-{newer.name} and loads {ck.name}")
    files = [p for p in ck.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    kinds: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for p in files:
        rel = p.relative_to(ck)
        kind = ("reference-layout shards (weights, with AdamW state when layout-free)" if rel.parts[0] == "reference"
                else "client state (step, data position, RNG)" if rel.name.startswith("client_rank")
                else "marker" if rel.name == ckpt.MARKER else "DeepSpeed's files (model, optimizer partitions)")
        kinds[kind] += 1
        sizes[kind] += p.stat().st_size
    if (ck / ckpt.MARKER).is_dir():
        lines += [f"complete      no: {ck / ckpt.MARKER} is a directory, not a marker file (a save writes its "
                  f"{ckpt.MARKER} marker as a JSON file, last): --resume auto skips this checkpoint; to use it, "
                  "restore the checkpoint from a copy",
                  f"files         {len(files)}, {total:,} bytes"]
        return "\n".join(lines), 1
    if not (ck / ckpt.MARKER).is_file():
        lines += [f"complete      no: no {ckpt.MARKER} marker (a save that did not finish: --resume auto skips it)",
                  f"files         {len(files)}, {total:,} bytes"]
        return "\n".join(lines), 1
    try:
        meta = ckpt.read_marker(ck)
    except ConfigError as e:
        lines += [f"complete      marker present, but damaged: {e}", f"files         {len(files)}, {total:,} bytes"]
        return "\n".join(lines), 1
    gaps = ckpt.layout_gaps(ck, meta)
    problems = gaps + (ckpt.verify(ck) if verify else ckpt.missing_listed(ck, meta))
    if problems:
        damage = "; ".join(problems[:4]) + (f", and {len(problems) - 4} more" if len(problems) > 4 else "")
        if not gaps:  # a file missing or changed: the marker's own messages give the fix
            damage += (": --resume auto sets this checkpoint aside (checkpoints/damaged-<tag>) and continues from "
                       "the previous one that verifies; to use this one, restore the file(s) from a copy")
        lines.append(f"complete      marker present, but damaged: {damage}")
    else:
        lines.append("complete      yes" + (" (every file's SHA-256 verified)" if verify else
                                           " (marker present, every listed file present; --verify checks SHA-256)"))
    lines += [f"step          {meta['step']} ({meta['tokens_seen']:,} tokens seen)",
              f"layout        {ckpt.describe_layout(meta)}"]
    if "global_batch_samples" in meta:
        lines.append(f"batch         global batch {meta['global_batch_samples']} samples of micro-batch "
                     f"{meta['micro_batch_size']}")
    held = ckpt.holds(meta)
    if problems:
        free = "no: the checkpoint is damaged (above); it resumes nowhere until restored from a copy"
    elif held["removed_by"] is not None:
        free = (f"no: its reference shards were removed by pruning once {held['removed_by']} was complete "
                "(train.reference_weights newest or minimal); resumes at its own layout only (the run's newest "
                "checkpoint keeps its shards)")
    else:
        free = "yes: resumes at any layout below" if held["layout_free"] else "no: resumes at its own layout only"
    lines.append(f"layout-free   {free}")
    if problems and held["reference_weights"]:
        lines.append("reference     listed, but the checkpoint is damaged (above): `smelt-ds export` reads the shards "
                     "only if they verify")
    else:
        lines.append(f"reference     {'yes' if held['reference_weights'] else 'no'} (the fp32 weights in the reference "
                     "layout, reference/rank*.pt)")
    lines.append(f"files         {len(files)}, {total:,} bytes")
    for kind, n in sorted(kinds.items()):
        lines.append(f"  {n:4d}  {sizes[kind]:>16,} bytes  {kind}")
    if problems:
        instead = ckpt.auto_choice(ck.parent.parent, verify)[0]
        then = (f"from {instead.name} (its marker is sound; its files are checked then)"
                if instead is not None and instead != ck else "from the newest checkpoint that verifies")
        lines.append(f"resumable at  nowhere: damaged; --resume auto moves it to checkpoints/damaged-<tag> and "
                     f"continues {then}")
        return "\n".join(lines), 1
    config = Path(recipe) if recipe else ck.parent.parent / "config.yaml"
    if not config.is_file():
        lines.append(f"resumable at  (no recipe: {config} does not exist; pass --recipe)")
        return "\n".join(lines), 0
    layouts = resumable_layouts(load_config(config), meta, max_ranks)
    lines.append(f"resumable at  (recipe {config}; ZeRO stages per backend and EP size)")
    by_world: dict[int, list[str]] = {}
    for lay in layouts:
        stages = lay["zero_stages"]
        zero = f"ZeRO {stages[0]}-{stages[-1]}" if len(stages) > 1 else f"ZeRO {stages[0]}"
        ep = "" if lay["moe_backend"] == "reference" else f" EP {lay['ep_size']}"
        by_world.setdefault(lay["world_size"], []).append(f"{lay['moe_backend']}{ep} ({zero})")
    for world, items in sorted(by_world.items()):
        lines.append(f"  {world:4d} rank(s): {'; '.join(items)}")
    return "\n".join(lines), 0


def run_info(args: argparse.Namespace) -> int:
    text, status = checkpoint_info(Path(args.path), args.recipe, args.max_ranks, args.verify)
    print(text)
    return status
