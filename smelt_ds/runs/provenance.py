"""Tokenizer provenance: a run, its checkpoints and its exports carry the tokenizer they were
trained with, and everything that reads them uses that tokenizer.

A number computed with another tokenizer than the model's is silently wrong: the model scores
token ids it never saw (only the vocabulary size would match). So:

* training copies the prepared data's ``tokenizer.json`` into the run directory
  (``<run_dir>/tokenizer.json``); a resume whose data come with another tokenizer is refused,
  naming both SHA-256 digests (of the canonical JSON, :func:`smelt_ds.runs.tokenizer_file.tokenizer_hash`);
* ``smelt-ds export`` copies it into the export;
* ``smelt-ds eval``, ``analyze`` and ``generate`` tokenise with the export's tokenizer, whatever
  ``--set data...`` says, and refuse a ``data.tokenizer.path`` with another tokenizer unless
  ``--allow-other-tokenizer`` is given;
* ``train.init_from`` trains on with the export's tokenizer (it becomes ``data.tokenizer.path``
  in the resolved recipe, so ``config.yaml`` says what ran) and refuses another one unless
  ``train.init_from_any_tokenizer`` is true.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import TOKENIZER_FILE, load_tokenizer, tokenizer_hash

__all__ = ["RUN_TOKENIZER", "tokenizer_file_hash", "record_run_tokenizer", "with_tokenizer", "init_from_tokenizer"]

RUN_TOKENIZER = "tokenizer.json"


def tokenizer_file_hash(path: str | Path) -> str:
    """SHA-256 (hex) of a ``tokenizer.json``'s canonical JSON. Raises ConfigError naming the file."""

    return tokenizer_hash(load_tokenizer(path, str(path)))


def record_run_tokenizer(run_dir: Path, prepared, resuming: bool) -> None:
    """Copy the prepared data's tokenizer into ``run_dir`` (rank 0), or, when resuming a run
    that recorded one, check that it is the same.

    Raises ConfigError naming both digests when a resumed run's data were tokenised with another
    tokenizer than the run's."""

    recorded = run_dir / RUN_TOKENIZER
    if resuming and recorded.is_file():
        have = tokenizer_file_hash(recorded)
        if have != prepared.tokenizer_hash:
            raise ConfigError(f"--resume: the run was trained with tokenizer {have[:16]} ({recorded}) but the "
                              f"recipe's data come with tokenizer {prepared.tokenizer_hash[:16]} "
                              f"({prepared.root}): resume with the run's data section, or set "
                              f"data.tokenizer.path={recorded}")
        return
    tmp = recorded.with_name(RUN_TOKENIZER + ".tmp")
    shutil.copyfile(Path(prepared.root) / TOKENIZER_FILE, tmp)
    os.replace(tmp, recorded)


def with_tokenizer(cfg, tokenizer_file: Path, allow_other: bool, what: str):
    """``cfg`` whose data are tokenised with ``tokenizer_file`` (a run's or export's tokenizer).

    A ``data.tokenizer.path`` already naming a tokenizer with the same digest is kept; one with
    another digest raises ConfigError naming both (``what`` says which option allows it), or is
    kept when ``allow_other``."""
    want = tokenizer_file_hash(tokenizer_file)
    path = cfg.data.tokenizer.path
    if path is not None and Path(path).resolve() != Path(tokenizer_file).resolve():
        have = tokenizer_file_hash(path)
        if have == want or allow_other:
            return cfg
        raise ConfigError(f"`data.tokenizer.path` ({path}) is tokenizer {have[:16]}, but the model was trained with "
                          f"tokenizer {want[:16]} ({tokenizer_file}): its token ids mean other text to this model; "
                          f"drop the override to use the model's tokenizer, or {what}")
    tok = cfg.data.tokenizer.model_copy(update={"path": str(tokenizer_file)})
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"tokenizer": tok})})


def init_from_tokenizer(cfg):
    """The recipe with ``train.init_from``'s tokenizer (see the module docstring); ``cfg``
    unchanged without ``train.init_from`` or when the export has no ``tokenizer.json`` (an
    export of an older smelt-ds)."""
    if not cfg.train.init_from:
        return cfg
    exported = Path(cfg.train.init_from) / RUN_TOKENIZER
    if not exported.is_file():
        return cfg
    return with_tokenizer(cfg, exported, cfg.train.init_from_any_tokenizer,
                          "set train.init_from_any_tokenizer: true to train the weights on with another tokenizer")
