"""Checkpoints: DeepSpeed's own save/load plus client state, made crash-safe.

Layout under ``<run_dir>/checkpoints/``::

    step00000050/            DeepSpeed's files (model, optimizer, scheduler state per rank)
    step00000050/client_rank{r}.pt   step, tokens seen, data-loader state and RNG states of rank r
    step00000050/reference/rank{r}.pt   rank r's shard of the fp32 weights in the reference
                             layout (:mod:`smelt_ds.runs.reference_weights`), what ``smelt-ds export``
                             reads for every MoE backend and ZeRO stage; which checkpoints carry
                             them is ``train.reference_weights`` (:func:`writes_reference`)
    step00000050/COMPLETE    written by rank 0 after every rank finished: the only mark of a
                             usable checkpoint; JSON with the step, tokens seen, the layout that
                             wrote it (world size, ZeRO stage, MoE backend, expert-parallel size),
                             which a resume must match, and every file with its SHA-256 and size

A run killed during a save (SIGKILL, node loss) leaves a directory without ``COMPLETE``, which
``--resume auto`` ignores: it continues from the newest complete checkpoint. A checkpoint is
damaged when a file differs from its digest (:func:`verify`) or when its marker is not one
(:class:`Marker`: not JSON, a missing key, a value of the wrong type, a file path outside the
directory, a step other than the directory's) or does not list every file its layout needs
(:func:`layout_gaps`): ``--resume auto`` moves it to ``damaged-<tag>`` and continues from the
next newest (:func:`choose`). Only the newest
``keep_last`` complete checkpoints are kept. With ``train.reference_weights`` ``newest`` or
``minimal``, the reference shards of the older checkpoints are removed once a newer checkpoint is
complete: their marker is rewritten without them (atomically) before the files are deleted, so no
marker ever lists a missing file, and the newest complete checkpoint is exportable at every moment.
The rewritten marker says what the checkpoint still holds (``reference_weights`` and
``layout_free`` false, ``reference_removed_by``: :func:`holds`): it resumes at its own layout only.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast, get_args

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from smelt_ds.config.moe import MoERuntimeConfig
from smelt_ds.config.train import resolve_batch
from smelt_ds.errors import ConfigError
from smelt_ds.parallel import control
from smelt_ds.runs.reference_weights import REFERENCE_DIR, gather_reference_shard, shard_path

__all__ = ["checkpoint_dir", "save", "choose", "load", "load_from", "latest_complete", "read_marker", "verify",
           "rng_state", "restore_rng", "MARKER", "run_layout", "describe_layout",
           "check_layout", "REFERENCE_CHOICES", "offline_exportable", "writes_reference", "reference_files",
           "newest_with_reference", "holds", "Marker", "layout_gaps", "marker_damage", "newest_sound",
           "missing_listed", "auto_choice"]

MARKER = "COMPLETE"
#: the values of ``train.reference_weights`` (:func:`writes_reference`)
REFERENCE_CHOICES = ("every_save", "newest", "minimal")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _step_tag(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch CPU and (when present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (e.g. no space left on device); names the file."""


#: what the message of :func:`_write_error` says the user can do, by errno
_FIXES = {errno.ENOSPC: "free space or point train.run_dir elsewhere",
          errno.EDQUOT: "free space, raise the quota or point train.run_dir elsewhere",
          errno.EACCES: "make the run directory writable by this user or point train.run_dir elsewhere",
          errno.EPERM: "make the run directory writable by this user or point train.run_dir elsewhere",
          errno.EROFS: "the file system is read-only: remount it read-write or point train.run_dir elsewhere"}
_KEPT = "the previous complete checkpoint is untouched and --resume auto continues from it"


def _write_error(e: OSError, path: str | Path, nbytes: int | None = None,
                 kept: str = _KEPT) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` for ``e`` raised writing ``path`` (``e.filename`` when it
    names one): the errno's name and text, the file, the fix; for a full device (ENOSPC, EDQUOT)
    also the bytes it needs (``nbytes``, when known) and the bytes free; then ``kept`` (what is
    left to resume from)."""
    code = e.errno if isinstance(e.errno, int) else None
    name = errno.errorcode.get(code, f"errno {code}") if code is not None else type(e).__name__
    text = e.strerror or (os.strerror(code) if code is not None else str(e)) or "no message"
    where = Path(os.fsdecode(e.filename)) if e.filename else Path(path)
    space = ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"free {shutil.disk_usage(where.parent).free:,}"
        except OSError:
            free = "free unknown"
        space = f" ({'needs about ' + format(nbytes, ',') + ' bytes; ' if nbytes is not None else ''}{free})"
    fix = _FIXES.get(code if code is not None else -1, "check the device and the file system (dmesg, df, mount); "
                     "point train.run_dir elsewhere if it keeps failing")
    return CheckpointWriteError(f"{name}: {text} writing {where}{space}: {fix}; {kept}")


class _HashingWriter(io.RawIOBase):
    """A write-only, sequential file object that feeds every byte to SHA-256 as it writes.

    ``torch.save`` writes its archive sequentially to a non-seekable file object (both the zip
    and the legacy format), so the digest is computed while writing, without reading back."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0
        self.error: OSError | None = None  # the first write error (torch's zip writer may hide it)

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b)
        self.sha.update(view)
        self.n += view.nbytes
        try:
            return self.f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise

    def tell(self) -> int:
        return self.n


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: about what ``torch.save`` writes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hashed(obj: Any, path: str | Path, zipfile: bool = True) -> dict[str, Any]:
    """``torch.save(obj, path)`` through a SHA-256 computed while writing, then fsync.

    Returns ``{"sha256", "bytes"}`` of the file. Raises :class:`CheckpointWriteError` for any
    OSError (opening, writing, fsync, closing; also inside torch's zip writer, which reports it as
    a RuntimeError) naming the errno, the file and the fix (:func:`_write_error`); for a full
    device (ENOSPC, EDQUOT) also the bytes it needs and the bytes free."""
    path = Path(path)
    w: _HashingWriter | None = None
    try:
        with open(path, "wb") as f:
            w = _HashingWriter(f)
            torch.save(obj, cast(IO[bytes], w), _use_new_zipfile_serialization=zipfile)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch's zip writer turns a failed write into a RuntimeError
        cause = e if isinstance(e, OSError) else (w.error if w is not None else None)
        if cause is None:
            raise
        raise _write_error(cause, path, _nbytes(obj)) from None
    assert w is not None  # set before torch.save ran
    return {"sha256": w.sha.hexdigest(), "bytes": w.n}


def file_digest(path: str | Path) -> dict[str, Any]:
    """``{"sha256", "bytes"}`` of a file, read in 16 MiB blocks."""
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            sha.update(block)
            n += len(block)
    return {"sha256": sha.hexdigest(), "bytes": n}


class _HashingCheckpointEngine:
    """Wraps DeepSpeed's ``TorchCheckpointEngine`` so that every file DeepSpeed writes goes through
    :func:`write_hashed` (digest while writing, fsync, a clear error on a full disk); the digests
    of this rank's files are collected in ``written`` (path -> digest).

    With ``defer`` (set by :func:`_write_rank_files` around ``engine.save_checkpoint``), a failed
    write is kept in ``error`` instead of raised and the later files of the save are skipped:
    DeepSpeed's save goes on to its collectives (its closing barrier), so a rank that failed alone
    does not leave the others waiting there while it waits in a different collective."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.written: dict[str, dict[str, Any]] = {}
        self.defer = False
        self.error: CheckpointWriteError | None = None

    def save(self, state_dict, path: str):
        if self.defer and self.error is not None:
            return  # this rank's save already failed: nothing more is written
        try:
            self.written[str(Path(path).resolve())] = write_hashed(state_dict, path, self.inner.zipfile_serialization)
        except CheckpointWriteError as e:
            if not self.defer:
                raise
            self.error = e

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _hashing_engine(engine) -> _HashingCheckpointEngine | None:
    """Install (once) the hashing wrapper on a DeepSpeed engine using the plain torch engine."""
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, _HashingCheckpointEngine):
        return current
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    if type(current) is not TorchCheckpointEngine:
        return None  # another checkpoint engine (configured by the user): files are hashed after the save
    engine.checkpoint_engine = _HashingCheckpointEngine(current)
    return engine.checkpoint_engine


def _atomic_save(obj: Any, path: Path) -> dict[str, Any]:
    tmp = path.with_name(path.name + ".tmp")
    digest = write_hashed(obj, tmp)
    os.replace(tmp, path)
    return digest


def offline_exportable(layout: dict[str, Any]) -> bool:
    """Whether DeepSpeed's own files of a checkpoint written with ``layout`` (:func:`run_layout`)
    give its fp32 weights without the reference shards: the reference backend at ZeRO 1-3, whose
    fp32 master partitions DeepSpeed's ``zero_to_fp32`` consolidates. Not the expert-parallel
    backends (``zero_to_fp32`` reads neither their per-expert files nor AutoEP at ZeRO-3), nor
    ZeRO-0 (its model file holds the bf16 weights under bf16, not the fp32 master)."""
    return layout.get("moe_backend", "reference") == "reference" and int(layout.get("zero_stage", 0)) >= 1


def writes_reference(choice: str, layout: dict[str, Any], final: bool) -> bool:
    """Whether a save writes the reference shards under ``train.reference_weights`` = ``choice``.

    ``every_save`` and ``newest``: every save (``newest`` then removes them from the older
    checkpoints). ``minimal``: only the run's last save (``final``: ``train.max_steps`` or a stop)
    where DeepSpeed's files export every checkpoint (:func:`offline_exportable`), else every save
    (the newest checkpoint must be exportable after a crash at any moment). Raises ValueError
    for another choice."""
    if choice not in REFERENCE_CHOICES:
        raise ValueError(f"train.reference_weights {choice!r} is not one of {REFERENCE_CHOICES}")
    return final or choice != "minimal" or not offline_exportable(layout)


def _write_rank_files(engine, root: Path, tag: str, rank: int, client: dict[str, Any], backend: str,
                      reference: bool, optimizer_state: bool = False) -> tuple[dict, CheckpointWriteError | None]:
    """DeepSpeed's files, the client state and (``reference``) the reference shard of this rank:
    ``(their digests, None)``, or ``(..., the first CheckpointWriteError)`` when a write failed
    (any OSError: :func:`_write_error`). After a failure this rank writes nothing more but still
    takes part in the save's collectives (DeepSpeed's barriers, the reference shard's gathers),
    so that every rank reaches :func:`save`'s exchange of errors."""

    if not reference and rank == 0:  # no shard of an abandoned earlier attempt may enter the marker
        shutil.rmtree(root / tag / REFERENCE_DIR, ignore_errors=True)
    hashing = _hashing_engine(engine)
    error: CheckpointWriteError | None = None
    if hashing is not None:
        hashing.written, hashing.error, hashing.defer = {}, None, True
    try:  # `latest` is written by _prune once the checkpoint is complete, never before
        engine.save_checkpoint(str(root), tag=tag, client_state={"step": client["step"],
                                                                "tokens_seen": client["tokens_seen"]},
                               save_latest=False)
    except CheckpointWriteError as e:  # not deferred (no hashing engine installed)
        error = e
    except OSError as e:  # DeepSpeed's own writes (another checkpoint engine, a directory)
        error = _write_error(e, root / tag)
    finally:
        if hashing is not None:
            hashing.defer = False
    error = error or (hashing.error if hashing is not None else None)
    ckpt = (root / tag).resolve()
    written = {str(Path(p).relative_to(ckpt)): d for p, d in (hashing.written if hashing else {}).items()
               if Path(p).is_relative_to(ckpt)}

    def attempt(name: str, write: Callable[[], dict[str, Any]]) -> None:
        nonlocal error
        if error is not None:
            return
        try:
            written[name] = write()
        except CheckpointWriteError as e:
            error = e
        except OSError as e:  # a rename, a directory
            error = _write_error(e, root / tag / name)

    attempt(f"client_rank{rank}.pt", lambda: _atomic_save(client, root / tag / f"client_rank{rank}.pt"))
    if not reference:
        return written, error
    shard = gather_reference_shard(engine, backend, optimizer=optimizer_state)  # collective: also after a failure
    path = shard_path(root / tag, rank)

    def write_shard() -> dict[str, Any]:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _atomic_save(shard, path)

    attempt(str(path.relative_to(root / tag)), write_shard)
    return written, error


def save(engine, run_dir: str | Path, step: int, tokens_seen: int, loader_state: dict[str, Any],
         keep_last: int, layout: dict[str, Any] | None = None, reference_weights: str = "every_save",
         final: bool = False, reference: bool | None = None, client_extra: dict[str, Any] | None = None,
         optimizer_state: bool = True) -> Path:
    """Save a checkpoint on every rank (collective). Returns the checkpoint directory.

    Writes DeepSpeed's files, this rank's client state and, when :func:`writes_reference` says
    so for ``reference_weights`` (``train.reference_weights``) and ``final`` (the run's last save:
    ``train.max_steps`` or a stop), its shard of the reference-layout weights
    (:func:`smelt_ds.runs.reference_weights.gather_reference_shard`, 4 bytes per parameter over
    all ranks), each with a SHA-256 computed while writing and fsynced; then, once every rank is
    done, rank 0 fsyncs the directory and writes the ``COMPLETE`` marker: JSON with the step,
    tokens seen, ``layout`` (see :func:`run_layout`; its ``moe_backend``, default ``reference``,
    names the backend whose parameters are mapped) and ``files`` (relative path -> sha256, bytes,
    writing rank). Then it prunes to the newest ``keep_last`` complete checkpoints and, unless
    ``every_save``, removes the reference shards of the older ones (:func:`_drop_reference`).
    ``reference`` True/False writes the shards or not whatever the choice says (bench/checkpoint_cost.py
    measures both); None follows the choice. ``client_extra``: more entries of this rank's client
    state (e.g. the step guard's, :mod:`smelt_ds.train.step_guard`), returned by :func:`load`.
    ``optimizer_state`` (``train.layout_free_state``): every save writes the reference shards
    (``minimal`` then acts as ``newest``) and they also hold AdamW's moments and step; the marker
    says ``"layout_free": true``: the checkpoint resumes at any layout (:mod:`smelt_ds.runs.reshard`).
    The marker's ``"reference_weights"`` says whether it holds the reference shards; both flags turn
    false when pruning removes the shards (:func:`_drop_reference`, :func:`holds`).

    Raises :class:`CheckpointWriteError` on every rank when any rank could not write (any
    OSError: a full disk, a permission error, a failing device; the message names the rank, the
    file, the errno and the fix), or when rank 0 could not write the marker: no marker is
    written (the partial directory is removed), nothing is pruned, so the previous complete
    checkpoints stay and the newest of them is what ``--resume auto`` continues from.
    """
    import torch.distributed as dist

    root = checkpoint_dir(run_dir)
    tag = _step_tag(step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = {"world_size": world, **(layout or {})}
    client = {**(client_extra or {}), "step": step, "tokens_seen": tokens_seen, "loader": loader_state,
              "rng": rng_state()}
    if reference is None:  # the layout-free state needs the shards in every save (minimal then acts as newest)
        reference = writes_reference(reference_weights, layout, final) or optimizer_state
    written, failed = _write_rank_files(engine, root, tag, rank, client, layout.get("moe_backend", "reference"),
                                        reference, optimizer_state)
    error = None if failed is None else (f"rank {rank} could not write checkpoint {root / tag}: {failed}"
                                         if world > 1 else f"could not write checkpoint {root / tag}: {failed}")
    gathered = control.gather_objects((written, error))
    errors = [e for _, e in gathered if e]
    if errors:
        if rank == 0:  # no marker was written: the partial directory is no checkpoint, only used space
            shutil.rmtree(root / tag, ignore_errors=True)
        more = f" (and {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
        raise CheckpointWriteError(errors[0] + more)
    error = None
    if rank == 0:
        meta = {"step": step, "tokens_seen": tokens_seen, **layout, "reference_weights": bool(reference),
                "layout_free": bool(reference and optimizer_state)}
        error = _complete(root, tag, gathered, meta, keep_last, reference_weights != "every_save")
    error = control.broadcast_object(error, src=0)  # also the barrier: no rank goes on before the marker is written
    if error:
        raise CheckpointWriteError(error)
    return root / tag


def _complete(root: Path, tag: str, gathered: list[Any], meta: dict[str, Any], keep_last: int,
              drop_reference: bool) -> str | None:
    """Rank 0, once every rank wrote its files: the digests of the small files no rank hashed, the
    directory fsynced, the ``COMPLETE`` marker, then the pruning (only now: the older complete
    checkpoints stay until this one is complete). The message of a failure (any OSError), else
    None; a failure before the marker is written removes the partial directory."""
    try:
        files = {name: {**d, "rank": r} for r, (w, _) in enumerate(gathered) for name, d in w.items()}
        for p in sorted((root / tag).rglob("*")):  # files no rank hashed while writing (small ones)
            name = str(p.relative_to(root / tag))
            if p.is_file() and name not in files and name != MARKER and not name.endswith(".tmp"):
                files[name] = {**file_digest(p), "rank": 0}
        _fsync_dir(root / tag)
        _write_marker(root / tag, {**meta, "files": files})
    except OSError as e:
        shutil.rmtree(root / tag, ignore_errors=True)  # a marker not known to be durable is none
        return f"could not complete checkpoint {root / tag}: {_write_error(e, root / tag / MARKER)}"
    try:
        _prune(root, keep_last, drop_reference=drop_reference)
    except OSError as e:
        return (f"checkpoint {root / tag} is complete, but removing the older ones failed: "
                f"{_write_error(e, root, kept=f'--resume auto continues from {tag}')}")
    return None


class _FileDigest(BaseModel):
    """One file of a checkpoint as its ``COMPLETE`` marker lists it (:func:`_complete`)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file's bytes, 64 hex digits")
    size: int = Field(alias="bytes", ge=0, description="size in bytes")
    rank: int = Field(0, ge=0, description="global rank that wrote it")


#: the MoE backends a marker may name (``moe_runtime.backend``'s values)
_BACKENDS = get_args(MoERuntimeConfig.model_fields["backend"].annotation)
#: a checkpoint directory's name: ``stepNNNNNNNN``, or ``damaged-stepNNNNNNNN[-k]`` once set aside
_TAG = re.compile(r"(?:damaged-)?step(\d+)(?:-\d+)?")
#: DeepSpeed's file of one expert of one MoE layer (``DeepSpeedEngine._get_expert_ckpt_name``)
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")


class Marker(BaseModel):
    """What a ``COMPLETE`` marker is (:func:`save` writes it, :func:`read_marker` checks it).

    Strict JSON types (a count written as a string or a boolean is refused); keys smelt-ds does not
    know are kept and ignored (a newer smelt-ds may add some). ``files`` maps each file's path,
    relative to the checkpoint directory and inside it, to its digest; None in markers of smelt-ds
    before digests (then the files on disk are what the checkpoint holds)."""

    model_config = ConfigDict(strict=True, extra="allow")
    step: int = Field(ge=0, description="optimizer steps done")
    tokens_seen: int = Field(ge=0, description="training tokens read")
    world_size: int = Field(ge=1, description="ranks that wrote the checkpoint")
    zero_stage: int = Field(ge=0, le=3, description="ZeRO stage as DeepSpeed saw it")
    moe_backend: str = Field(description="moe_runtime.backend")
    ep_size: int = Field(ge=1, description="expert-parallel size (1 for the reference backend)")
    micro_batch_size: int | None = Field(None, ge=1, description="samples per micro-batch and rank")
    global_batch_samples: int | None = Field(None, ge=1, description="samples per optimizer step")
    reference_weights: bool | None = Field(None, description="holds the reference shards (:func:`holds`)")
    layout_free: bool = Field(False, description="the shards hold AdamW's state too: resumes at any layout")
    reference_removed_by: str | None = Field(None, description="the checkpoint whose completion pruned the shards")
    files: dict[str, _FileDigest] | None = None

    @field_validator("moe_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v not in _BACKENDS:
            raise ValueError(f"{v!r} is not a MoE backend ({', '.join(_BACKENDS)})")
        return v

    @field_validator("files")
    @classmethod
    def _inside(cls, files: dict[str, _FileDigest] | None) -> dict[str, _FileDigest] | None:
        for name in files or {}:
            parts = PurePosixPath(name).parts
            if (not name or "\0" in name or name.startswith("/") or str(PurePosixPath(name)) != name
                    or any(p in (".", "..") for p in parts)):
                raise ValueError(f"names {name!r}, a path outside the checkpoint directory (the files are relative "
                                 "paths inside it, without '..')")
            if name == MARKER:
                raise ValueError(f"lists the marker {MARKER} itself")
        return files

    @model_validator(mode="after")
    def _consistent(self) -> Marker:
        if self.moe_backend == "reference" and self.ep_size != 1:
            raise ValueError(f"ep_size {self.ep_size} with moe_backend 'reference' (which has no expert parallelism)")
        if self.world_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} does not divide world_size {self.world_size}")
        if (self.micro_batch_size is None) != (self.global_batch_samples is None):
            raise ValueError("micro_batch_size and global_batch_samples come together (one is missing)")
        if self.global_batch_samples is not None and self.global_batch_samples % (
                cast(int, self.micro_batch_size) * self.world_size):
            raise ValueError(f"global_batch_samples {self.global_batch_samples} is not micro_batch_size "
                             f"{self.micro_batch_size} x accumulation x world_size {self.world_size}")
        bad = sorted(n for n, d in (self.files or {}).items() if d.rank >= self.world_size)
        if bad:
            raise ValueError(f"{bad[0]!r} written by rank {(self.files or {})[bad[0]].rank}, but world_size is "
                             f"{self.world_size}")
        return self


def _schema_problems(e: ValidationError) -> str:
    """The problems of a :class:`Marker` ValidationError, each as ``key: what (got value)``."""
    out = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            out.append(f"no {where!r} (the saver always writes it)")
        elif not where or err["type"] == "value_error":  # our validators name the value themselves
            out.append(f"{where + ': ' if where else ''}{msg}")
        else:
            out.append(f"{where}: {msg} (got {err['input']!r:.60})")
    return "; ".join(out)


_REPAIR = ("--resume auto sets the checkpoint aside (checkpoints/damaged-<tag>) and continues from the newest one "
           "that verifies; to use this one, restore it from a copy")


def read_marker(ckpt: str | Path) -> dict[str, Any]:
    """The ``COMPLETE`` marker of checkpoint directory ``ckpt``, as written (a dict; absent optional
    keys stay absent), checked against :class:`Marker`.

    Raises ConfigError naming the file, each problem (unreadable, not JSON, not a JSON object, a
    missing key, a value of the wrong type or range, a file path outside the directory, a ``step``
    other than the directory name's ``stepNNNNNNNN``) and the fix: a damaged marker (markers are
    written atomically, so only a damaged disk or a hand edit makes one)."""
    f = Path(ckpt) / MARKER
    try:
        meta = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{f} is damaged: not JSON ({type(e).__name__}: {str(e)[:80]}): {_REPAIR}") from None
    except OSError as e:
        raise ConfigError(f"{f} is damaged: it cannot be read ({e.strerror or e}): {_REPAIR}") from None
    if not isinstance(meta, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
                type(None): "null"}[type(meta)]
        raise ConfigError(f"{f} is damaged: not a checkpoint marker (JSON {kind}, not an object with step, layout "
                          f"and files): {_REPAIR}")
    try:
        Marker.model_validate(meta)
    except ValidationError as e:
        raise ConfigError(f"{f} is damaged: {_schema_problems(e)}: {_REPAIR}") from None
    tag = _TAG.fullmatch(Path(ckpt).name)
    if tag and int(tag.group(1)) != meta["step"]:
        raise ConfigError(f"{f} is damaged: step {meta['step']} in a directory named {Path(ckpt).name} (the saver "
                          f"names it {_step_tag(meta['step'])}): {_REPAIR}")
    return meta


def _needed(meta: dict[str, Any], names: set[str]) -> list[tuple[tuple[str, ...], str]]:
    """The files a checkpoint with marker ``meta`` holds whatever its model, as ``(names, what)``:
    one of ``names`` must be there. The one rule, from the layout (:func:`run_layout`) and what the
    marker says it holds (:func:`holds`):

    - every rank ``r``: ``client_rank{r}.pt`` (:func:`save`);
    - DeepSpeed's model states: ``mp_rank_00_model_states.pt``, or at ZeRO-3 one
      ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank;
    - at ZeRO 1-3, every rank's optimizer partition ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``;
    - an expert-parallel backend below ZeRO-3 writes ``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``
      for every MoE layer ``l`` and expert ``e`` (none in a model without MoE layers), so the listed ones
      must form the whole grid of layers x experts, and at ZeRO-0 ``expp_rank_{p}_mp_rank_00_optim_states.pt``
      per expert-parallel rank ``p`` (DeepSpeed's ``DeepSpeedEngine._save_moe_checkpoint``);
    - with the reference shards or the layout-free state (:func:`holds`), every rank's shard
      ``reference/rank{r:05d}.pt``.

    ``names``: the files the checkpoint holds (the expert grid is read from them). Counts far
    beyond the files there are (a damaged digit: more ranks than files, a grid far larger than the
    expert files) give one need no file meets, so nothing is enumerated beyond them."""
    world, zero, ep = meta["world_size"], meta["zero_stage"], meta["ep_size"]
    if world > len(names) + 1024:
        return [((), f"the files of {world} ranks ({len(names)} files in all)")]
    needs: list[tuple[tuple[str, ...], str]] = [((f"client_rank{r}.pt",), f"rank {r}'s client state")
                                                for r in range(world)]
    if zero == 3:
        needs += [((f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",), f"rank {r}'s ZeRO-3 model states")
                  for r in range(world)]
    else:
        needs.append((("mp_rank_00_model_states.pt",), "DeepSpeed's model states"))
    if zero >= 1:
        needs += [((name, f"bf16_{name}"), f"rank {r}'s ZeRO optimizer partition")
                  for r in range(world) for name in [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]]
    grid = [(int(m[1]), int(m[2])) for n in names if (m := _EXPERT_FILE.fullmatch(n))]
    if meta["moe_backend"] != "reference" and zero < 3 and grid:
        layers, experts = max(g[0] for g in grid) + 1, max(g[1] for g in grid) + 1
        if layers * experts > 2 * len(grid) + 64:
            return needs + [((), f"the expert files of {layers} MoE layers x {experts} experts ({len(grid)} listed)")]
        needs += [((f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt",), f"expert {e} of MoE layer {layer}")
                  for layer in range(layers) for e in range(experts)]
        if zero == 0:
            needs += [((f"expp_rank_{p}_mp_rank_00_optim_states.pt",), f"expert-parallel rank {p}'s optimizer state")
                      for p in range(ep)]
    held = holds(meta)
    if held["reference_weights"] or held["layout_free"]:
        claim = "the layout-free state the marker claims" if held["layout_free"] else "the reference weights"
        needs += [((shard_path(Path(), r).as_posix(),), f"rank {r}'s reference shard, {claim}") for r in range(world)]
    return needs


def layout_gaps(ckpt: str | Path, meta: dict[str, Any]) -> list[str]:
    """What checkpoint ``ckpt`` with marker ``meta`` (:func:`read_marker`) lacks of the files its
    layout needs (:func:`_needed`): one line naming the marker, the layout, the first missing files
    and the fix, or an empty list. A marker with digests must list them (a file it does not list
    is not verified, so it is not part of the checkpoint); one without (older smelt-ds) must have
    them on disk. Reads no file's contents."""
    ckpt = Path(ckpt)
    files = meta.get("files")
    names = set(files) if files is not None else {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")
                                                   if p.is_file()}
    missing = [f"{' or '.join(alts)} ({what})" if alts else what for alts, what in _needed(meta, names)
               if not any(a in names for a in alts)]
    if not missing:
        return []
    how = "does not list" if files is not None else "has no file digests (an older smelt-ds), and its directory lacks"
    more = f", and {len(missing) - 4} more" if len(missing) > 4 else ""
    return [f"{ckpt / MARKER} is damaged: it {how} {len(missing)} file(s) its layout ({describe_layout(meta)}) "
            f"needs: {'; '.join(missing[:4])}{more}: {_REPAIR}"]


def marker_damage(ckpt: str | Path) -> list[str]:
    """What makes the marker of checkpoint ``ckpt`` damaged, without reading any other file: the
    error of :func:`read_marker`, or :func:`layout_gaps`; an empty list for a sound marker. The
    SHA-256 of the files is :func:`verify`'s."""
    try:
        meta = read_marker(ckpt)
    except ConfigError as e:
        return [str(e)]
    return layout_gaps(ckpt, meta)


def newest_sound(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` whose marker is sound (:func:`marker_damage`),
    or None: the one ``--resume auto`` loads unless a file's SHA-256 differs (:func:`choose`).
    Reads the markers only."""
    return next((p for p in reversed(_complete_tags(checkpoint_dir(run_dir))) if not marker_damage(p)), None)


def missing_listed(ckpt: str | Path, meta: dict[str, Any]) -> list[str]:
    """The files marker ``meta`` (:func:`read_marker`) of checkpoint ``ckpt`` lists that are not
    on disk, one line each naming the file; reads no file's contents."""
    return [f"{Path(ckpt) / f} is missing" for f in (meta.get("files") or {}) if not (Path(ckpt) / f).is_file()]


def auto_choice(run_dir: str | Path, sha256: bool = False) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """What ``--resume auto`` (:func:`choose`) does with ``run_dir``, moving nothing: the checkpoint
    it loads (None when none is left) and the newer complete ones it sets aside, newest first, each
    with its problems: a damaged marker (:func:`marker_damage`), then a listed file missing, or
    with ``sha256`` a file that differs from its digest (:func:`verify`, which reads every file)."""
    aside: list[tuple[Path, list[str]]] = []
    for path in reversed(_complete_tags(checkpoint_dir(run_dir))):
        problems = marker_damage(path) or (verify(path) if sha256 else missing_listed(path, read_marker(path)))
        if not problems:
            return path, aside
        aside.append((path, problems))
    return None, aside


def verify(path: str | Path, rank: int | None = None, names: list[str] | None = None,
           world_size: int | None = None) -> list[str]:
    """Problems of checkpoint ``path`` against the digests in its ``COMPLETE`` marker.

    Checks the files written by ``rank`` (all files when None), or only ``names``. With
    ``world_size`` (the ranks checking now, which may be fewer than wrote it: a resume at another
    layout), ``rank`` checks the files of every writing rank ``w`` with ``w % world_size == rank``,
    so that the ranks together check every file. Returns one line per problem (missing file, wrong
    size, wrong SHA-256), naming the file; an empty list when everything matches or the marker
    predates checksums."""
    path = Path(path)
    try:
        files = read_marker(path).get("files")
    except ConfigError as e:
        return [str(e)]
    if files is None:
        return []
    problems = []
    for name, want in sorted(files.items()):
        writer = want.get("rank", 0) % world_size if world_size else want.get("rank", 0)
        if (names is not None and name not in names) or (names is None and rank is not None and writer != rank):
            continue
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{f} has {size:,} bytes, {want['bytes']:,} when written")
        elif file_digest(f)["sha256"] != want["sha256"]:
            problems.append(f"{f} has another SHA-256 than when written (damaged)")
    return problems


def run_layout(cfg, world_size: int) -> dict[str, Any]:
    """What a checkpoint's files depend on besides the model: ``world_size`` (ranks),
    ``zero_stage`` (as DeepSpeed sees it), ``moe_backend`` and ``ep_size`` (expert-parallel
    size; 1 for the reference backend); and the batch a resume at another layout keeps:
    ``micro_batch_size`` and ``global_batch_samples`` (micro-batch x accumulation x ranks).
    Stored in the ``COMPLETE`` marker."""
    rt = cfg.moe_runtime  # the marker keeps its pre-issue-14 key names, so old checkpoints still load
    accum, _ = resolve_batch(cfg.train, world_size)
    return {"world_size": world_size, "zero_stage": cfg.deepspeed.zero_stage, "moe_backend": rt.backend,
            "ep_size": rt.ep_size if rt.backend != "reference" else 1,
            "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_samples": cfg.train.micro_batch_size * accum * world_size}


def describe_layout(layout: dict[str, Any]) -> str:
    """A layout (:func:`run_layout`, a ``COMPLETE`` marker) in words, for messages:
    ``"2 rank(s), ZeRO-3, autoep, EP 2"``; a key the layout lacks reads ``None``."""
    return (f"{layout.get('world_size')} rank(s), ZeRO-{layout.get('zero_stage')}, {layout.get('moe_backend')}, "
            f"EP {layout.get('ep_size')}")


_LAYOUT_WORDS = {"world_size": "ranks (data-parallel x expert-parallel)", "zero_stage": "ZeRO stage",
                 "moe_backend": "moe_runtime.backend", "ep_size": "moe_runtime.ep_size (expert-parallel size)"}


def check_layout(path: str | Path, layout: dict[str, Any]) -> None:
    """Refuse to resume checkpoint ``path`` with another layout than the one that wrote it.

    DeepSpeed's checkpoints hold per-rank optimizer partitions and per-expert-parallel-rank
    experts; loading them into another number of ranks, ZeRO stage, backend or expert-parallel
    size either fails deep inside DeepSpeed or, worse, loads the wrong partition. Raises
    ConfigError naming each difference and the supported path (``smelt-ds export`` then
    ``train.init_from``, which starts a new run from the weights at any scale). Fields an older
    marker lacks are not compared. Raises ConfigError for a damaged marker (:func:`read_marker`)."""
    meta = read_marker(path)
    diffs = [f"{_LAYOUT_WORDS[k]} {meta[k]!r} in the checkpoint vs {v!r} now" for k, v in layout.items()
             if k in meta and k in _LAYOUT_WORDS and meta[k] != v]
    if diffs:
        raise ConfigError(f"checkpoint {path} was written with another layout ({'; '.join(diffs)}): resume it with "
                          "the same layout, or continue at the new scale from its weights (the optimizer state "
                          f"starts fresh): `smelt-ds export {Path(path).parent.parent} -o EXPORT_DIR`, then "
                          "train with --set train.init_from=EXPORT_DIR in a new --run-dir")


def _complete_tags(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step*") if (p / MARKER).is_file()), key=lambda p: p.name)


def _write_marker(ckpt: Path, meta: dict[str, Any]) -> None:
    """Write (or replace) the ``COMPLETE`` marker of ``ckpt`` atomically: a temporary file,
    fsynced, renamed over the marker, then the directory fsynced."""
    marker = ckpt / MARKER
    tmp = marker.with_name(MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)
    _fsync_dir(ckpt)


def reference_files(ckpt: str | Path) -> list[str] | None:
    """The reference shards (relative paths) the ``COMPLETE`` marker of ``ckpt`` lists; None for
    a marker without file digests (older smelt-ds), whose shards are whatever ``reference/`` holds,
    and for a damaged marker (:func:`read_marker`; :func:`verify` names the damage)."""
    try:
        files = read_marker(ckpt).get("files")
    except ConfigError:
        return None
    return None if files is None else sorted(n for n in files if n.startswith(REFERENCE_DIR + "/"))


def newest_with_reference(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (a ``checkpoints/`` directory) whose marker
    lists reference shards, or None."""
    return next((p for p in reversed(_complete_tags(Path(root))) if reference_files(p)), None)


def holds(meta: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint with ``COMPLETE`` marker ``meta`` (:func:`read_marker`) holds besides
    DeepSpeed's files and the client state: ``{"reference_weights": bool, "layout_free": bool,
    "removed_by": str | None}``.

    ``reference_weights``: the reference-layout shards ``smelt-ds export`` reads; ``layout_free``:
    those shards with AdamW's moments, what a resume at another layout needs
    (:mod:`smelt_ds.runs.reshard`); ``removed_by``: the newer checkpoint whose completion made
    pruning remove the shards (``train.reference_weights`` ``newest`` or ``minimal``), else None.
    Read from the marker's flags and ``reference_removed_by``: a marker rewritten by an older
    smelt-ds when it removed the shards kept ``"layout_free": true`` (but has
    ``reference_removed_by``); a marker without ``reference_weights`` (older) holds the shards its
    file list names (all of ``reference/`` without digests)."""
    removed = meta.get("reference_removed_by")
    files = meta.get("files")
    listed = files is None or any(n.startswith(REFERENCE_DIR + "/") for n in files)
    reference = bool(meta.get("reference_weights", listed)) and removed is None
    return {"reference_weights": reference, "layout_free": bool(meta.get("layout_free")) and removed is None,
            "removed_by": removed}


def _drop_reference(ckpt: Path, newer: str) -> None:
    """Remove the reference shards of the complete checkpoint ``ckpt`` (``newer``: the checkpoint
    that made them redundant, recorded in the marker as ``reference_removed_by``).

    The marker is rewritten first (atomically, :func:`_write_marker`) to say what the checkpoint
    still holds: the shards leave its file list, and ``reference_weights`` and ``layout_free``
    turn false (it resumes at its own layout only, :func:`holds`); then the files are deleted: a
    crash in between leaves unlisted files, never a listed file missing (which :func:`verify`
    would call damaged). Checkpoints whose marker has no digests (older smelt-ds) or is damaged
    (:func:`read_marker`: :func:`choose` sets them aside) are left alone."""
    try:
        meta = read_marker(ckpt)
    except ConfigError:
        return
    files = meta.get("files")
    if files is None:
        return
    listed = [n for n in files if n.startswith(REFERENCE_DIR + "/")]
    if listed or meta.get("layout_free") or meta.get("reference_weights"):
        meta["files"] = {n: d for n, d in files.items() if n not in listed}
        meta["reference_removed_by"] = meta.get("reference_removed_by") or newer
        meta["reference_weights"] = meta["layout_free"] = False
        _write_marker(ckpt, meta)
    shutil.rmtree(ckpt / REFERENCE_DIR, ignore_errors=True)  # also what a crash here left last time


def _prune(root: Path, keep_last: int, drop_reference: bool = False) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (and a newer partial one being written);
    with ``drop_reference``, the kept older ones lose their reference shards."""
    complete = _complete_tags(root)
    keep = set(complete[-keep_last:])
    newest = complete[-1].name if complete else ""
    for p in root.glob("step*"):
        if p in keep:
            continue
        if (p / MARKER).is_file() or p.name < newest:  # old complete, or an abandoned partial save
            shutil.rmtree(p, ignore_errors=True)
    if drop_reference:
        for p in complete[-keep_last:-1]:
            _drop_reference(p, newest)
    latest = root / "latest"  # DeepSpeed's pointer; keep it on a complete tag
    if complete:
        latest.write_text(complete[-1].name)


def latest_complete(run_dir: str | Path) -> Path | None:
    """Newest checkpoint directory carrying the COMPLETE marker, or None."""
    tags = _complete_tags(checkpoint_dir(run_dir))
    return tags[-1] if tags else None


def _verify_everywhere(path: Path) -> list[str]:
    """A damaged marker (:func:`marker_damage`: its content, or files its layout needs that it does
    not list), else the files' digests: the ranks check the files in parallel, each those a rank
    ``w`` with ``w % world == rank`` wrote (its own at the writing layout; every file also when
    fewer ranks resume it); the union of the problems (each once), on all ranks."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = marker_damage(path) or (verify(path, rank, world_size=world) if world > 1 else verify(path))
    return list(dict.fromkeys(p for problems in control.gather_objects(mine) for p in problems))


def _quarantine(path: Path) -> Path:
    """Move a damaged checkpoint out of the ``step*`` namespace (never deleted; not pruned)."""
    dest = path.with_name(f"damaged-{path.name}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"damaged-{path.name}-{n}")
    os.replace(path, dest)
    return dest


def _choose(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to load: ``--resume PATH`` if it verifies, or the newest complete one that
    verifies (collective). Damaged newer ones are moved aside with a message."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if resume != "auto":
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise ConfigError(f"--resume {resume!r} is not a complete checkpoint (no {MARKER} marker): pass "
                              "a checkpoints/stepNNNNNNNN directory written to the end, or --resume auto")
        problems = _verify_everywhere(path)
        if problems:
            raise ConfigError(f"--resume {resume}: the checkpoint is damaged ({'; '.join(problems[:3])}): pass an "
                              "earlier checkpoint, or --resume auto to take the newest one that verifies")
        return path
    damaged = []
    for path in reversed(_complete_tags(checkpoint_dir(run_dir))):
        problems = _verify_everywhere(path)
        if not problems:
            return path
        damaged.append(path.name)
        if rank == 0:
            moved = _quarantine(path)
            print(f"checkpoint {path} is damaged ({'; '.join(problems[:3])}): moved to {moved} (kept, not "
                  "deleted); trying the next newest complete checkpoint", file=sys.stderr)
        control.barrier()
    if damaged:  # never start again from step 0 over a run whose checkpoints are all damaged
        raise ConfigError(f"--resume auto: no checkpoint of {run_dir} verifies (damaged: {', '.join(damaged[:4])}, "
                          "moved to checkpoints/damaged-*): nothing to continue from; start a new run in a new "
                          "--run-dir")
    return None


def choose(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``--resume`` loads (collective): ``auto``, the newest complete checkpoint of
    ``run_dir`` whose marker is sound (:func:`marker_damage`: it reads as a :class:`Marker` and lists
    every file its layout needs) and whose files match the SHA-256 digests in it (a damaged newer
    one is moved to ``damaged-<tag>`` with a message saying why, and the next newest is tried; None
    when none is left), or the checkpoint directory ``resume`` names. Raises ConfigError for a
    directory that is not a complete checkpoint or is damaged (naming the file and the problem)."""
    return _choose(Path(run_dir), resume)


def load(engine, run_dir: str | Path, resume: str, layout: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Load a checkpoint into ``engine`` and return this rank's client state (collective).

    ``resume``: ``auto`` or a checkpoint directory (:func:`choose`); None when ``auto`` finds none.

    Raises:
        ConfigError: a directory that is not a complete checkpoint or is damaged (naming the
            file); one written with another layout (:func:`check_layout` with ``layout``, or at
            least by a different number of ranks); a checkpoint without digests (older smelt-ds)
            that DeepSpeed cannot read (naming the checkpoint and DeepSpeed's error).
    """
    path = choose(run_dir, resume)
    return None if path is None else load_from(engine, path, layout)


def load_from(engine, path: Path, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load checkpoint ``path`` (chosen and verified by :func:`choose`) into ``engine`` through
    DeepSpeed, at the layout that wrote it; this rank's client state. Raises ConfigError as
    :func:`load` does."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    check_layout(path, layout or {"world_size": dist.get_world_size() if dist.is_initialized() else 1})
    client_file = path / f"client_rank{rank}.pt"
    if not client_file.is_file():
        meta = read_marker(path)
        raise ConfigError(f"checkpoint {path} has no state for rank {rank}: it was written by "
                          f"{meta.get('world_size')} rank(s); resume with that many ranks")
    try:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
    except (RuntimeError, OSError, EOFError, AssertionError, KeyError, ValueError) as e:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else 'no message'}): it is damaged or from another "
                          "recipe; resume an earlier checkpoint with --resume checkpoints/stepNNNNNNNN") from None
    if load_path is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}: is it complete and from this recipe?")
    return torch.load(client_file, weights_only=False)
