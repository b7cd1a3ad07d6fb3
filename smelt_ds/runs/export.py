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
from pathlib import Path

import torch

from smelt_ds.config.loading import dump_config, load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.files import staged_directory
from smelt_ds.model import SmeltLM
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.provenance import RUN_TOKENIZER
from smelt_ds.runs.reference_weights import has_reference_shards, merge_reference_shards

__all__ = ["REFERENCE_OVERRIDES", "WEIGHTS_DIGEST", "consolidated_state_dict", "export_checkpoint", "load_exported",
           "load_initial_weights", "save_weights"]


#: ``--set`` overrides under which an export's recipe loads as one CPU reference-backend model, whatever
#: it trained with: no expert parallelism, no ZeRO, and no in-loop harness evals (their include path may
#: be gone on the machine that reads the export).
REFERENCE_OVERRIDES = ["moe_runtime.backend=reference", "moe_runtime.ep_size=1", "deepspeed.zero_stage=0",
                       "eval.harness_tasks=[]", "eval.harness_interval=null", "eval.harness_include_path=null"]


def _resolve(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` from a run directory or a checkpoint directory."""
    path = Path(path)
    if (path / ckpt.MARKER).is_file():
        return path.parent.parent, path
    latest = ckpt.latest_complete(path)
    if latest is None:
        raise ConfigError(f"{str(path)!r} holds no complete checkpoint (no checkpoints/step*/{ckpt.MARKER}): "
                          "pass a run directory of a run that saved at least once")
    return path, latest


def consolidated_state_dict(ckpt_dir: Path, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """fp32 state dict of the model in the reference layout, from any ZeRO stage and backend.

    A checkpoint whose marker lists reference-layout shards (gathered on the live engine at save
    time: :mod:`smelt_ds.runs.reference_weights`) is merged from them, checked for completeness.
    One without them (``train.reference_weights`` ``newest``/``minimal`` keep them only where
    needed, or an older smelt-ds) is read from DeepSpeed's own files on the reference backend:
    ``zero_to_fp32`` (ZeRO 1-3) or the rank-0 model file (ZeRO-0). Raises ConfigError naming the
    file for a missing or damaged shard, and for an expert-parallel checkpoint without shards
    (naming the newest checkpoint of the run that has them).
    """

    meta = json.loads((ckpt_dir / ckpt.MARKER).read_text())
    if ckpt_dir.name.startswith("damaged-") and (problems := ckpt.verify(ckpt_dir)):
        raise ConfigError(f"checkpoint {ckpt_dir} was moved aside as damaged ({'; '.join(problems[:3])}): export "
                          f"an intact checkpoint ({ckpt_dir.parent}/stepNNNNNNNN)")
    shards = ckpt.reference_files(ckpt_dir)
    if shards or (shards is None and has_reference_shards(ckpt_dir)):
        problems = ckpt.verify(ckpt_dir, names=shards or [])
        if problems:
            raise ConfigError(f"checkpoint {ckpt_dir} is damaged ({'; '.join(problems[:3])}): export an earlier "
                              f"checkpoint ({ckpt_dir.parent}/stepNNNNNNNN)")
        return merge_reference_shards(ckpt_dir, cfg, int(meta.get("world_size", 1)))
    backend = meta.get("moe_backend", cfg.moe_runtime.backend)
    if backend != "reference":
        raise _no_reference_weights(ckpt_dir, meta, backend)
    if int(meta.get("zero_stage", cfg.deepspeed.effective_zero_stage)) == 0:
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
#: the file `smelt-ds export --format hf` writes last (smelt_ds.interop.export): a directory holding
#: it is an earlier export, which an export may replace
HF_MARKER = "smelt_ds_export.json"


def _check_output(out: Path) -> None:
    """An export may replace an earlier export or fill an empty directory, nothing else."""
    if out.is_file() or out.is_symlink():
        raise ConfigError(f"export output {str(out)!r} is a file: pass a directory path (-o DIR)")
    if out.is_dir():
        present = {p.name for p in out.iterdir()}
        if present and not present <= EXPORT_FILES and HF_MARKER not in present:
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

    Raises ConfigError when ``path`` holds no complete checkpoint, or when ``out_dir`` is a file
    or a non-empty directory other than an earlier export (never deletes anything else)."""
    run_dir, ckpt_dir = _resolve(path)
    cfg = load_config(run_dir / "config.yaml")
    out = Path(out_dir)
    _check_output(out)
    state = consolidated_state_dict(ckpt_dir, cfg)
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
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("expert_bias")]
    if missing or unexpected:
        raise ConfigError(f"{path / 'model.pt'} does not fit the recipe: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    return model.eval()


def load_initial_weights(model, path: str | Path) -> None:
    """Copy the weights of an export directory into ``model`` (a :class:`SmeltLM` with reference
    MoE layers, before :func:`smelt_ds.parallel.moe_backends.apply_backend`), for ``train.init_from``.

    The export is always in the reference layout, so this is how weights move between MoE
    backends (export from a ``deepspeed`` or ``autoep`` run, start a run on another backend or
    expert-parallel size). Buffers absent from the export (the aux-loss-free ``expert_bias``)
    keep their initial values. Raises ConfigError naming ``train.init_from`` for a missing or
    partial export or weights of another shape.
    """
    path = Path(path)
    weights = path / "model.pt"
    if not weights.is_file() or not (path / "config.yaml").is_file():
        raise ConfigError(f"`train.init_from` ({str(path)!r}) is not an export directory (needs model.pt and "
                          "config.yaml): create one with `smelt-ds export RUN_DIR -o OUT`")
    state = _load_weights(weights, "`train.init_from`: ")
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    missing = [k for k in own if k not in state and not k.endswith("expert_bias")]
    unexpected = [k for k in state if k not in own]
    if wrong or missing or unexpected:
        raise ConfigError(f"`train.init_from`: {weights} does not fit this recipe's model (shape export vs "
                          f"recipe: {wrong[:3]}; missing {missing[:3]}; unexpected {unexpected[:3]}): use an "
                          "export of a run with the same model, moe.num_experts and unique layers")
    model.load_state_dict(state, strict=False)
