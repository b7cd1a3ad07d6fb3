"""Export a DeepSpeed checkpoint as consolidated fp32 weights plus the resolved recipe.

``<out>/model.pt`` holds a state dict in the reference layout (``SmeltLM`` with the reference MoE
backend) and ``<out>/config.yaml`` the resolved recipe; :func:`load_exported` rebuilds the model
on one CPU process, whatever the MoE backend, ZeRO stage and expert-parallel size of the run
(the checkpoint's reference-layout shards, :mod:`smelt_ds.runs.reference_weights`). The output is
written to a temporary directory and renamed, so a partial export is never taken for a complete one.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from smelt_ds.config.loading import dump_config, load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.files import relative_rule, staged_directory
from smelt_ds.model import SmeltLM
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.provenance import RUN_TOKENIZER
from smelt_ds.runs.reference_weights import has_reference_shards, merge_reference_shards

__all__ = ["REFERENCE_OVERRIDES", "WEIGHTS_DIGEST", "check_init_from", "consolidated_state_dict", "export_checkpoint",
           "load_exported", "load_initial_weights", "readable_checkpoint", "save_weights", "write_export"]


#: ``--set`` overrides under which an export's recipe loads as one CPU reference-backend model, whatever
#: it trained with: no expert parallelism, no ZeRO, and no in-loop harness evals (their include path may
#: be gone on the machine that reads the export).
REFERENCE_OVERRIDES = ["moe_runtime.backend=reference", "moe_runtime.ep_size=1", "deepspeed.zero_stage=0",
                       "eval.harness_tasks=[]", "eval.harness_interval=null", "eval.harness_include_path=null"]


def _read_problems(ckpt_dir: Path) -> list[str]:
    """:func:`smelt_ds.runs.checkpoint.verify`'s problems of the files an export of ``ckpt_dir``
    reads: its reference shards when its marker lists them (damage to the optimizer states does not
    change an export), else every file; every file of a checkpoint moved aside as damaged."""
    shards = ckpt.reference_files(ckpt_dir)
    if shards and not ckpt_dir.name.startswith("damaged-"):
        return ckpt.verify(ckpt_dir, names=shards)
    return ckpt.verify(ckpt_dir)


def _complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (``checkpoints/step*/COMPLETE``), newest first."""
    root = ckpt.checkpoint_dir(run_dir)
    return sorted((p for p in root.glob("step*") if (p / ckpt.MARKER).is_file()), key=lambda p: p.name, reverse=True)


def _damaged(ckpt_dir: Path, problems: list[str]) -> ConfigError:
    """The error for an explicit checkpoint directory whose files do not verify: the problems, and
    the newest checkpoint of its run that verifies (a real path) to read instead."""
    run_dir = ckpt_dir.parent.parent
    what = "was moved aside as damaged" if ckpt_dir.name.startswith("damaged-") else "is damaged"
    head = f"checkpoint {ckpt_dir} {what} ({'; '.join(problems[:3])})"
    instead = next((p for p in _complete_checkpoints(run_dir)
                    if p.resolve() != ckpt_dir.resolve() and not _read_problems(p)), None)
    if instead is not None:
        return ConfigError(f"{head}: use {instead} instead, the newest checkpoint of {run_dir} whose files verify "
                           f"(or pass the run directory {run_dir}, which takes it)")
    return ConfigError(f"{head}, and no other checkpoint of {run_dir} verifies: restore the checkpoint from a copy, "
                       "or train the run again")


def readable_checkpoint(path: str | Path,
                        exported: Callable[[Path], bool] | None = None) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` to read the weights of, from a run directory or a checkpoint directory.

    A run directory gives its newest complete checkpoint whose files verify (the files an export
    reads: the reference shards, else every file; :func:`smelt_ds.runs.checkpoint.verify`), as
    ``--resume auto`` chooses; when a newer one is damaged, a message on stderr names it, what is
    wrong and the checkpoint used instead. Nothing is moved: readers leave the run as it is.
    ``exported(checkpoint_dir)`` says a checkpoint already has a usable export (a run's export
    cache); such a checkpoint is taken as it is, without reading its files.

    Raises ConfigError for a path with no complete checkpoint, a run none of whose checkpoints
    verifies (naming each), and a checkpoint directory that does not verify (naming the newest
    checkpoint of its run that does, when there is one)."""
    path = Path(path)
    if (path / ckpt.MARKER).is_file():
        if (exported is None or not exported(path)) and (problems := _read_problems(path)):
            raise _damaged(path, problems)
        return path.parent.parent, path
    candidates = _complete_checkpoints(path)
    if not candidates:
        raise ConfigError(f"{str(path)!r} holds no complete checkpoint (no checkpoints/step*/{ckpt.MARKER}): "
                          "pass a run directory of a run that saved at least once")
    damaged: list[str] = []
    for candidate in candidates:
        problems = [] if exported is not None and exported(candidate) else _read_problems(candidate)
        if not problems:
            if damaged:
                print(f"warning: {'; '.join(damaged)}: using {candidate} instead, the newest checkpoint of {path} "
                      "whose files verify (the damaged one is left where it is; `smelt-ds train --resume auto` "
                      "moves it aside)", file=sys.stderr)
            return path, candidate
        damaged.append(f"checkpoint {candidate} is damaged ({'; '.join(problems[:3])})")
    raise ConfigError(f"no checkpoint of {path} verifies ({'; '.join(damaged[:4])}): nothing to read the weights "
                      "from; restore a checkpoint from a copy, or train the run again")


def consolidated_state_dict(ckpt_dir: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """fp32 state dict of the model in the reference layout, from any ZeRO stage and backend.

    A checkpoint whose marker lists reference-layout shards (gathered on the live engine at save
    time: :mod:`smelt_ds.runs.reference_weights`) is merged from them, checked for completeness.
    One without them (``train.reference_weights`` ``newest``/``minimal`` keep them only where
    needed, or an older smelt-ds) is read from DeepSpeed's own files on the reference backend:
    ``zero_to_fp32`` (ZeRO 1-3) or the rank-0 model file (ZeRO-0). Raises ConfigError naming the
    file for a missing or damaged file it reads (and the newest checkpoint of the run that
    verifies), and for an expert-parallel checkpoint without shards (naming the newest checkpoint
    of the run that has them).
    """

    if problems := _read_problems(ckpt_dir):
        raise _damaged(ckpt_dir, problems)
    return _consolidate(ckpt_dir, cfg)


def _consolidate(ckpt_dir: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """:func:`consolidated_state_dict` of a checkpoint whose files were verified."""
    meta = json.loads((ckpt_dir / ckpt.MARKER).read_text())
    shards = ckpt.reference_files(ckpt_dir)
    if shards or (shards is None and has_reference_shards(ckpt_dir)):
        return merge_reference_shards(ckpt_dir, cfg, int(meta.get("world_size", 1)))
    backend = meta.get("moe_backend", cfg.moe_runtime.backend)
    if backend != "reference":
        raise _no_reference_weights(ckpt_dir, meta, backend)
    if int(meta.get("zero_stage", cfg.deepspeed.zero_stage)) == 0:
        files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ConfigError(f"{ckpt_dir}: no mp_rank_*_model_states.pt; is this a DeepSpeed checkpoint?")
        state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
        return {k: v.float() for k, v in state.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)


def _no_reference_weights(ckpt_dir: Path, meta: dict, backend: str) -> ConfigError:
    """The error for an expert-parallel checkpoint without reference shards: why it has none, and
    the checkpoint to export instead (the run's newest one with them)."""
    if "reference_removed_by" in meta:
        why = (f"they were removed when the newer {meta['reference_removed_by']} was saved (train.reference_weights "
               "keeps them in the newest checkpoint only)")
    elif "files" in meta:
        why = "the save did not write them"
    else:
        why = "it was written by an older smelt-ds"
    head = (f"{ckpt_dir} has no reference weights ({ckpt_dir}/reference/): {why}, and a moe_runtime.backend "
            f"{backend!r} checkpoint cannot be converted from DeepSpeed's files offline")
    instead = ckpt.newest_with_reference(ckpt_dir.parent)
    if instead is not None:
        return ConfigError(f"{head}: export {instead} instead (`smelt-ds export {instead} -o EXPORT_DIR`), the "
                           "newest checkpoint of the run that has them")
    return ConfigError(f"{head}: resume it for one step with this version (--resume auto, raising train.max_steps "
                       "by 1) and export the new checkpoint")


#: ``sha256sum`` line of model.pt, written with it and checked whenever an export is loaded
WEIGHTS_DIGEST = "model.pt.sha256"
EXPORT_FILES = frozenset({"model.pt", WEIGHTS_DIGEST, "config.yaml", "SOURCE", "tokenizer.json"})
#: the file `smelt-ds export --format hf` writes last (smelt_ds.interop.hf_export): a directory holding
#: it is an earlier export, which an export may replace
HF_MARKER = "smelt_ds_export.json"


def _check_output(out: Path) -> None:
    """An export may replace an earlier export of this format or fill an empty directory, nothing
    else (not a Hugging Face export, ``--format hf``)."""
    if out.is_file() or out.is_symlink():
        raise ConfigError(f"export output {str(out)!r} is a file: pass a directory path (-o DIR)")
    if out.is_dir():
        present = {p.name for p in out.iterdir()}
        if HF_MARKER in present:
            raise ConfigError(f"export output {str(out)!r} holds a Hugging Face export (`smelt-ds export --format hf`, "
                              f"{HF_MARKER}): refusing to replace it with a smelt-ds export (model.pt + config.yaml); "
                              "pass another -o DIR, or remove that directory first to replace it")
        if present and not present <= EXPORT_FILES:
            raise ConfigError(f"export output {str(out)!r} exists and holds other files "
                              f"({', '.join(sorted(present - EXPORT_FILES)[:4])}): refusing to replace it; "
                              "pass a new or empty directory, or an earlier export to overwrite")


def save_weights(state: dict[str, torch.Tensor], export_dir: Path) -> None:
    """Write ``export_dir/model.pt`` and its digest ``model.pt.sha256`` (one ``sha256sum`` line:
    ``sha256sum -c model.pt.sha256`` checks it by hand), which every load of the export checks."""
    torch.save(state, export_dir / "model.pt")
    digest = ckpt.file_digest(export_dir / "model.pt")["sha256"]
    (export_dir / WEIGHTS_DIGEST).write_text(f"{digest}  model.pt\n")


def _check_weights_digest(path: Path, field: str) -> None:
    """Compare ``path`` (a model.pt) with the digest written beside it; exports written before the
    digest existed have none and are not checked. Raises ConfigError naming both digests."""
    recorded = path.with_name(WEIGHTS_DIGEST)
    if not recorded.is_file():
        return
    want = (recorded.read_text().split() or [""])[0]
    have = ckpt.file_digest(path)["sha256"]
    if have != want:
        raise ConfigError(f"{field}{path} is damaged: its sha256 {have[:16]} is not the {want[:16] or 'empty'} "
                          f"recorded in {recorded} when it was written: write it again (`smelt-ds export` from "
                          "its checkpoint, or `smelt-ds import-hf` for imported weights; a run's cached export: "
                          "delete that exports/ directory and the next command re-exports it)")


def _load_weights(path: Path, field: str) -> dict[str, torch.Tensor]:
    _check_weights_digest(path, field)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ConfigError(f"{field}{path} is not a readable weights file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}): it may be truncated; export again") from None


def export_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Write ``model.pt``, ``config.yaml``, ``tokenizer.json`` (the run's, when it recorded one:
    :mod:`smelt_ds.runs.provenance`) and ``SOURCE`` (the checkpoint path) to ``out_dir``
    (atomically, through a staging directory beside it: :func:`smelt_ds.files.staged_directory`). Returns ``out_dir``.
    A run directory exports its newest checkpoint that verifies (:func:`readable_checkpoint`).

    Raises ConfigError when ``path`` holds no complete checkpoint or none that verifies, when the
    checkpoint directory ``path`` is damaged, or when ``out_dir`` is a file, a Hugging Face export
    or a non-empty directory other than an earlier export (never deletes anything else)."""
    out = Path(out_dir)
    _check_output(out)
    run_dir, ckpt_dir = readable_checkpoint(path)
    return write_export(run_dir, ckpt_dir, out)


def write_export(run_dir: Path, ckpt_dir: Path, out_dir: str | Path) -> Path:
    """:func:`export_checkpoint` of checkpoint ``ckpt_dir`` of ``run_dir``, chosen (and its files
    verified) by :func:`readable_checkpoint`. Returns ``out_dir``. Raises ConfigError as
    :func:`export_checkpoint` does for ``out_dir``, and as :func:`consolidated_state_dict` does."""
    cfg = load_config(run_dir / "config.yaml")
    out = Path(out_dir)
    _check_output(out)
    state = _consolidate(ckpt_dir, cfg)
    with staged_directory(out) as tmp:
        save_weights(state, tmp)
        dump_config(cfg, tmp / "config.yaml")
        if (run_dir / RUN_TOKENIZER).is_file():  # the tokenizer the model was trained with (provenance)
            shutil.copyfile(run_dir / RUN_TOKENIZER, tmp / RUN_TOKENIZER)
        (tmp / "SOURCE").write_text(str(ckpt_dir.resolve()) + "\n")
    return out


def load_exported(path: str | Path):
    """Build a :class:`smelt_ds.model.SmeltLM` (reference backend, eval mode) from an export
    directory. Raises ConfigError for a missing or partial export, or mismatched weights."""

    path = Path(path)
    if not (path / "model.pt").is_file() or not (path / "config.yaml").is_file():
        raise ConfigError(f"{str(path)!r} is not an export directory (needs model.pt and config.yaml): "
                          "create one with `smelt-ds export RUN_DIR -o OUT`")
    cfg = load_config(path / "config.yaml", REFERENCE_OVERRIDES)
    model = SmeltLM(cfg.model, cfg.moe, cfg.loop)
    state = _load_weights(path / "model.pt", "")
    problems = _misfit(model.state_dict(), state)
    if problems:
        raise ConfigError(f"{path / 'model.pt'} does not fit the recipe in {path / 'config.yaml'} ({problems}): "
                          "the export is partial or config.yaml was edited; export the checkpoint again "
                          f"(`smelt-ds export RUN_DIR -o {path}`)")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _keys(keys: list[str]) -> str:
    """``"N: a, b, c, d, ..."``: a count and the first few names."""
    return f"{len(keys)}: {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"


def _misfit(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], optional: tuple[str, ...] = ()) -> str:
    """What keeps ``state`` from loading into a model whose state dict is ``own`` (every parameter and
    persistent buffer, e.g. the aux-loss-free router's ``expert_bias``): missing keys (except those
    ending in one of ``optional``), unexpected keys and wrong shapes; ``""`` when it fits."""
    missing = [k for k in own if k not in state and not (optional and k.endswith(optional))]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    return "; ".join(f"{what} {_keys(keys)}" for what, keys in (
        ("missing", missing), ("unexpected", unexpected), ("wrong shape (file vs recipe)", wrong)) if keys)


def check_init_from(path: str | Path) -> Path:
    """``train.init_from`` as a path, after checking it is an export directory (``model.pt`` and
    ``config.yaml``). Raises ConfigError naming the field, the value and how to make one."""
    p = Path(path)
    if not (p / "model.pt").is_file() or not (p / "config.yaml").is_file():
        raise ConfigError(f"`train.init_from` ({str(path)!r}) is not an export directory (needs model.pt and "
                          f"config.yaml; {relative_rule(path)}): create one with `smelt-ds export RUN_DIR -o OUT`")
    return p


def load_initial_weights(model, path: str | Path) -> None:
    """Copy the weights of an export directory into ``model`` (a :class:`SmeltLM` with reference
    MoE layers, before :func:`smelt_ds.parallel.moe_backends.apply_backend`), for ``train.init_from``.

    The export is always in the reference layout, so this is how weights move between MoE
    backends (export from a ``deepspeed`` or ``autoep`` run, start a run on another backend or
    expert-parallel size). The aux-loss-free router bias (``expert_bias``) starts at zero when the
    export's own recipe had none (``moe.aux_loss_free_bias`` false), as in a new run; every other
    parameter and persistent buffer of ``model`` must be in the export. Raises ConfigError naming
    ``train.init_from`` for a missing or partial export (naming the missing keys) or weights of
    another shape.
    """
    path = check_init_from(path)
    weights = path / "model.pt"
    state = _load_weights(weights, "`train.init_from`: ")
    had_bias = load_config(path / "config.yaml", REFERENCE_OVERRIDES).moe.aux_loss_free_bias
    problems = _misfit(model.state_dict(), state, () if had_bias else ("expert_bias",))
    if problems:
        raise ConfigError(f"`train.init_from`: {weights} does not fit this recipe's model ({problems}): use an "
                          "export of a run with the same model, moe.num_experts and unique layers; a partial "
                          "export (keys missing that its own config.yaml uses): export it again")
    model.load_state_dict(state, strict=False)
