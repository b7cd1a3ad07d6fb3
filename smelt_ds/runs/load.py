"""Open runs for their readers (evaluation, Hugging Face export): run directories, checkpoint
directories or exports.

A run directory is consolidated once with :func:`smelt_ds.runs.export.export_checkpoint` (its newest
complete checkpoint that verifies) into ``<run_dir>/exports/<checkpoint tag>/`` and reused while that export's
``SOURCE`` still names the same checkpoint; an export directory (``model.pt`` + ``config.yaml``)
is loaded as it is. The model is the reference-backend :class:`smelt_ds.model.SmeltLM` on CPU in
eval mode; the data section of its recipe says where the validation data live.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from smelt_ds.config.loading import load_config
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.runs import checkpoint as ckpt
from smelt_ds.runs.export import REFERENCE_OVERRIDES, load_exported, readable_checkpoint, write_export
from smelt_ds.runs.provenance import RUN_TOKENIZER, with_tokenizer

if TYPE_CHECKING:
    from smelt_ds.model import SmeltLM

__all__ = ["LoadedRun", "resolve_export", "load_run", "load_runs", "describe_model"]


@dataclass
class LoadedRun:
    """One model under evaluation.

    Attributes:
        name: column name in tables and legends (recipe ``name`` unless given; made unique).
        path: what the user passed.
        export_dir: the export directory the weights came from.
        model: :class:`smelt_ds.model.SmeltLM`, CPU, eval mode.
        cfg: the resolved recipe (with the evaluation's ``--set`` overrides applied).
        eval_split: the prepared split evaluated: ``validation``, or ``train`` for a ``--corpus``
            (prepared with ``validation_share`` 0, so it holds every document).
    """

    name: str
    path: Path
    export_dir: Path
    model: SmeltLM
    cfg: RunConfig
    eval_split: str = "validation"  # "train" for `smelt-ds eval --corpus` (every document of the corpus)


def _is_export(path: Path) -> bool:
    return (path / "model.pt").is_file() and (path / "config.yaml").is_file()


def resolve_export(path: str | Path) -> Path:
    """The export directory for ``path`` (an export, a run directory or a checkpoint directory).

    Run and checkpoint directories are exported to ``<run_dir>/exports/<tag>/`` unless an export
    of the same checkpoint is already there; a run directory gives its newest checkpoint that
    verifies, or has an export there (:func:`smelt_ds.runs.export.readable_checkpoint`: a damaged
    newer one is named on stderr, and left where it is). Raises ConfigError for a path that is
    none of these, a damaged checkpoint directory, and a run none of whose checkpoints verifies.
    """

    path = Path(path)
    if _is_export(path):
        return path
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ConfigError(f"run {str(path)!r} {what}: pass a run directory (with "
                          f"checkpoints/step*/{ckpt.MARKER}) or an export directory (model.pt + config.yaml)")
    if (path / "config.json").is_file() and not (path / "checkpoints").is_dir():
        raise ConfigError(f"{str(path)!r} is a Hugging Face model directory (config.json), not a smelt-ds run or "
                          f"export: import it first (`smelt-ds import-hf {path} -o RECIPE.yaml`) and use the weights "
                          "directory it writes")
    if not (path / ckpt.MARKER).is_file() and ckpt.latest_complete(path) is None:
        raise ConfigError(f"run {str(path)!r} holds no complete checkpoint (no checkpoints/step*/{ckpt.MARKER}) "
                          "and is not an export (model.pt + config.yaml): train until a checkpoint is saved, "
                          "or pass an export directory")

    def cached(ckpt_dir: Path) -> bool:
        out = ckpt_dir.parent.parent / "exports" / ckpt_dir.name
        source = out / "SOURCE"
        return _is_export(out) and source.is_file() and source.read_text().strip() == str(ckpt_dir.resolve())

    run_dir, ckpt_dir = readable_checkpoint(path, exported=cached)
    out = run_dir / "exports" / ckpt_dir.name
    if cached(ckpt_dir):
        return out
    return write_export(run_dir, ckpt_dir, out)


def load_run(path: str | Path, overrides: list[str] | None = None, name: str | None = None,
             allow_other_tokenizer: bool = False) -> LoadedRun:
    """Export (if needed) and load one run. ``overrides`` are ``--set`` items applied to its recipe
    (e.g. ``data.cache_dir=...``). The data are tokenised with the tokenizer the run recorded
    (``tokenizer.json`` of the export, :mod:`smelt_ds.runs.provenance`), whatever the overrides say.

    Raises ConfigError; among others when ``data.tokenizer.path`` names another tokenizer than
    the run's (both digests named) and ``allow_other_tokenizer`` is false."""

    export_dir = resolve_export(path)
    model = load_exported(export_dir)
    cfg = load_config(export_dir / "config.yaml",
                      [*REFERENCE_OVERRIDES, *(overrides or [])])
    if (export_dir / RUN_TOKENIZER).is_file():
        cfg = with_tokenizer(cfg, export_dir / RUN_TOKENIZER, allow_other_tokenizer,
                             "pass --allow-other-tokenizer to score the model with it anyway")
    return LoadedRun(name or cfg.name, Path(path), export_dir, model, cfg)


def load_runs(paths: list[str], overrides: list[str] | None = None, names: list[str] | None = None,
              allow_other_tokenizer: bool = False) -> list[LoadedRun]:
    """Load every run; names default to the recipe names, made unique with ``-2``, ``-3``...

    Raises ConfigError when ``names`` is given with a different length than ``paths``.
    """
    if not paths:
        raise ConfigError("no run given: pass at least one run directory or export directory")
    if names is not None and len(names) != len(paths):
        raise ConfigError(f"`--names` ({','.join(names)}) has {len(names)} names for {len(paths)} runs: "
                          "give one name per run, comma-separated")
    runs: list[LoadedRun] = []
    seen: dict[str, int] = {}
    for i, p in enumerate(paths):
        run = load_run(p, overrides, names[i] if names else None, allow_other_tokenizer)
        base = run.name
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            run.name = f"{base}-{seen[base]}"
        runs.append(run)
    return runs


def describe_model(run: LoadedRun) -> dict:
    """Architecture facts printed next to the numbers: visit plan, unique layers, experts,
    non-embedding parameters (all experts counted; embedding and head excluded)."""
    model = run.model
    return {"name": run.name, "path": str(run.path), "export": str(run.export_dir),
            "loop_position": run.cfg.loop.position, "unique_layers": run.cfg.model.num_layers,
            "visits": model.schedule.effective_depth, "visit_plan": model.schedule.layers(),
            "num_experts": run.cfg.moe.num_experts, "top_k": run.cfg.moe.top_k,
            "non_embedding_params": model.num_non_embedding_params(),
            "max_seq_len": run.cfg.model.max_seq_len}
