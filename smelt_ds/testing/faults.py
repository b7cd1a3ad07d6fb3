"""Faults injected into real training processes, for tests and benchmarks of the failure paths.

A test starts training (``python -m smelt_ds.cli train RECIPE --nproc 2``, ``deepspeed --module
smelt_ds.train ...``, ``python -m smelt_ds.train ...``) with the environment of :func:`fault_env`::

    env = {**os.environ, **fault_env(["nan:rank=1:step=4", "save_error:rank=1:step=6:errno=EIO"])}

It puts ``smelt_ds/testing/fault_site`` (a ``sitecustomize.py`` only) first on ``PYTHONPATH`` and
the specs in ``SMELT_FAULTS``. Python imports ``sitecustomize`` at the start of every process (the
launchers pass the environment on to the ranks), which calls :func:`install_from_env`. In a
training process (``RANK`` or ``LOCAL_RANK`` set, or started as ``-m smelt_ds.train``, ``-m
smelt_ds.cli train``, ``smelt-ds train``) that installs an import hook: when
``smelt_ds.train.loop`` is imported, its module-level ``_train_step``, ``total_loss`` and step-end
collective (``sync_flag`` or ``agree``, whichever the loop has) are wrapped, and ``open`` too when
a ``save_error`` is asked for. Elsewhere (the launchers) nothing is patched.

Specs: ``kind:key=value:...``, several separated by ``;``. The step is the optimizer step being
trained, 1-based, as the loop counts it (after a resume from step 50 the first is 51); the rank
is ``RANK`` (0 when unset). Each fault fires at most once per process.

- ``nan:rank=R:step=S``: the training loss of rank R at step S is multiplied by NaN (the graph
  and the gradients are NaN);
- ``spike:rank=R:step=S:factor=F``: the loss of rank R at step S is multiplied by F;
- ``sleep:rank=R:step=S:seconds=X``: rank R sleeps X seconds in the control collective of step S
  (``agree``, at the accumulation boundary, after the step's forward and backward), as a rank
  hung in or around a collective;
- ``raise:rank=R:step=S``: rank R raises ``RuntimeError("injected fault: rank R step S")`` at the
  start of step S;
- ``save_error:rank=R:step=S[:errno=ENOSPC]``: rank R fails to write its first file of the
  checkpoint of step S (under ``checkpoints/stepSSSSSSSS/``): ``EACCES``, ``EPERM`` and ``EROFS``
  from ``open``, ``ENOSPC`` (the default), ``EDQUOT`` and ``EIO`` from the file's first ``write``,
  where a real file system reports them;
- ``exit:rank=R:step=S``: rank R ends with ``os._exit(137)`` at the start of step S (no traceback,
  no cleanup: as a SIGKILL or an out-of-memory kill);
- ``kill:rank=R:step=S``: rank R sends itself SIGKILL at the start of step S (a real SIGKILL: the
  kernel ends it, its launcher sees -9);
- ``stop:rank=R:step=S``: rank R sends itself SIGSTOP at the start of step S (a hung rank: alive,
  stopped, answering nothing until a SIGCONT);
- ``inf_grad:rank=R:step=S``: the gradient of rank R's training loss at step S is multiplied by
  +inf in the backward pass while the loss itself stays finite (every gradient that depends on
  the loss becomes inf or NaN, so the global gradient norm is non-finite).

The ledger: with ``SMELT_LEDGER=DIR`` (:func:`fault_env`'s ``ledger``), every rank appends one
JSON line to ``DIR/rank<R>.jsonl`` per optimizer step it trained, when the step returns: ``step``,
``rank``, ``pid`` (one process = one attempt of that rank), ``skipped`` (the step guard's reason or
null) and ``weights`` (SHA-256 of this rank's parameters after the step, the local ZeRO-3
partition where parameters are partitioned). The file is only ever appended to (``O_APPEND``): a
resume, which trims ``metrics.jsonl`` back to its checkpoint, leaves it whole, so
:func:`check_ledger` can see a step trained twice.

A bad spec raises ValueError naming it (:func:`fault_env` checks the specs before any process
starts; in ``sitecustomize`` Python would only print the error).
"""

from __future__ import annotations

import builtins
import errno
import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FAULTS_ENV", "LEDGER_ENV", "SITE_DIR", "KINDS", "Fault", "parse_faults", "fault_env", "install_from_env",
           "install", "patch_loop", "is_training_process", "read_ledger", "check_ledger", "LedgerError"]

#: the environment variable holding the fault specs (``;``-separated)
FAULTS_ENV = "SMELT_FAULTS"
#: the environment variable naming the ledger's directory (one append-only ``rank<R>.jsonl`` per rank)
LEDGER_ENV = "SMELT_LEDGER"
#: the directory put first on ``PYTHONPATH``: its ``sitecustomize.py`` calls :func:`install_from_env`
SITE_DIR = Path(__file__).resolve().parent / "fault_site"
#: the module whose functions are wrapped
LOOP_MODULE = "smelt_ds.train.loop"

#: kind -> (required keys, optional keys)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "nan": (("rank", "step"), ()),
    "spike": (("rank", "step", "factor"), ()),
    "sleep": (("rank", "step", "seconds"), ()),
    "raise": (("rank", "step"), ()),
    "save_error": (("rank", "step"), ("errno",)),
    "exit": (("rank", "step"), ()),
    "kill": (("rank", "step"), ()),
    "stop": (("rank", "step"), ()),
    "inf_grad": (("rank", "step"), ()),
}
#: the errors a ``save_error`` may raise; the first three from ``open``, the others from ``write``
SAVE_ERRNOS = {"EACCES": errno.EACCES, "EPERM": errno.EPERM, "EROFS": errno.EROFS,
               "ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EIO": errno.EIO}
_AT_OPEN = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class Fault:
    """One parsed spec: ``kind``, the ``rank`` and ``step`` it fires at, and its parameter
    (``factor`` of a spike, ``seconds`` of a sleep, ``errno`` of a save error)."""

    kind: str
    rank: int
    step: int
    factor: float = 1.0
    seconds: float = 0.0
    errno: int = errno.ENOSPC
    spec: str = ""


def _bad(spec: str, why: str) -> ValueError:
    kinds = ", ".join(KINDS)
    return ValueError(f"bad fault spec {spec!r}: {why} (expected kind:key=value:..., kinds {kinds}; e.g. "
                      "nan:rank=1:step=4, sleep:rank=0:step=3:seconds=30, save_error:rank=1:step=6:errno=EIO)")


def _parse_one(spec: str) -> Fault:
    kind, *pairs = [p.strip() for p in spec.split(":")]
    if kind not in KINDS:
        raise _bad(spec, f"unknown kind {kind!r}")
    required, optional = KINDS[kind]
    values: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise _bad(spec, f"{pair!r} is not key=value")
        if key not in required + optional:
            raise _bad(spec, f"{kind} takes {', '.join(required + optional)}, not {key!r}")
        if key in values:
            raise _bad(spec, f"{key} given twice")
        values[key] = value
    missing = [k for k in required if k not in values]
    if missing:
        raise _bad(spec, f"{kind} needs {', '.join(missing)}")

    def integer(key: str, least: int) -> int:
        try:
            n = int(values[key])
        except ValueError:
            raise _bad(spec, f"{key}={values[key]!r} is not an integer") from None
        if n < least:
            raise _bad(spec, f"{key}={n} is below {least}")
        return n

    def number(key: str) -> float:
        try:
            x = float(values[key])
        except ValueError:
            raise _bad(spec, f"{key}={values[key]!r} is not a number") from None
        if not math.isfinite(x) or (key == "seconds" and x < 0):
            raise _bad(spec, f"{key}={values[key]} is not a finite{' non-negative' if key == 'seconds' else ''} "
                             "number")
        return x

    fault = Fault(kind, integer("rank", 0), integer("step", 1), spec=spec)
    if kind == "spike":
        fault = Fault(kind, fault.rank, fault.step, factor=number("factor"), spec=spec)
    elif kind == "sleep":
        fault = Fault(kind, fault.rank, fault.step, seconds=number("seconds"), spec=spec)
    elif kind == "save_error":
        name = values.get("errno", "ENOSPC").upper()
        if name not in SAVE_ERRNOS:
            raise _bad(spec, f"errno={values['errno']!r} is not one of {', '.join(SAVE_ERRNOS)}")
        fault = Fault(kind, fault.rank, fault.step, errno=SAVE_ERRNOS[name], spec=spec)
    return fault


def parse_faults(text: str | Sequence[str]) -> list[Fault]:
    """The faults of ``text`` (``;``-separated specs) or of a list of specs. Blank parts are
    skipped. Raises ValueError naming the first bad spec."""
    parts = text.split(";") if isinstance(text, str) else [p for s in text for p in s.split(";")]
    return [_parse_one(p.strip()) for p in parts if p.strip()]


def fault_env(specs: str | Sequence[str], pythonpath: str | None = None,
              ledger: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment variables that inject ``specs`` into every training process started with
    them: ``PYTHONPATH`` (:data:`SITE_DIR` first, then ``pythonpath``, by default the current
    ``PYTHONPATH``) and ``SMELT_FAULTS``; with ``ledger`` (a directory), ``SMELT_LEDGER`` too (the
    ranks keep the ledger there: see the module doc). Merge them into ``os.environ`` (or a copy).
    Raises ValueError naming a bad spec."""
    faults = parse_faults(specs)
    existing = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    path = str(SITE_DIR) + (os.pathsep + existing if existing else "")
    env = {"PYTHONPATH": path, FAULTS_ENV: ";".join(f.spec.strip() for f in faults)}
    if ledger is not None:
        env[LEDGER_ENV] = str(Path(ledger).resolve())
    return env


def is_training_process(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> bool:
    """Whether this process trains: ``RANK`` or ``LOCAL_RANK`` is set (a rank under a launcher), or
    the command is ``python -m smelt_ds.train``, ``python -m smelt_ds.cli train`` or ``smelt-ds
    train`` (``argv``: by default ``sys.orig_argv``, the command line as given)."""
    environ = os.environ if environ is None else environ
    if environ.get("RANK") is not None or environ.get("LOCAL_RANK") is not None:
        return True
    args = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            module, rest = args[i + 1], args[i + 2:]
            return module == "smelt_ds.train" or (module == "smelt_ds.cli" and "train" in rest[:1])
        if Path(a).name == "smelt-ds":
            return "train" in args[i + 1:i + 2]
    return False


class _Injector:
    """The faults of this rank and the step being trained (set by the ``_train_step`` wrapper)."""

    def __init__(self, faults: list[Fault], rank: int, ledger: Path | None = None):
        self.rank, self.ledger = rank, ledger
        self.faults = [f for f in faults if f.rank == rank]
        self.fired: set[int] = set()
        self.step = 0  # the step being trained (1-based); 0 before the first
        self.in_step = False

    def due(self, kinds: tuple[str, ...], step: int) -> list[Fault]:
        """The faults of ``kinds`` at ``step`` not fired yet; marked fired."""
        out = []
        for i, f in enumerate(self.faults):
            if f.kind in kinds and f.step == step and i not in self.fired:
                self.fired.add(i)
                out.append(f)
        return out

    def save_fault(self, path: str) -> Fault | None:
        """The ``save_error`` (not fired yet) whose checkpoint directory holds ``path``; marked fired."""
        for i, f in enumerate(self.faults):
            if f.kind == "save_error" and i not in self.fired and \
                    f"{os.sep}checkpoints{os.sep}step{f.step:08d}{os.sep}" in path:
                self.fired.add(i)
                return f
        return None


class _FailingWrites:
    """A file opened for writing whose ``write`` fails with ``code`` (as a full disk or a failing
    device answers); everything else is the real file's."""

    def __init__(self, f, code: int):
        self._f, self._code = f, code

    def write(self, b):
        raise OSError(self._code, os.strerror(self._code))

    def writelines(self, lines):
        raise OSError(self._code, os.strerror(self._code))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


def _failing_open(injector: _Injector, real_open: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(real_open)
    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.abspath(os.fsdecode(file))
            fault = injector.save_fault(path)
            if fault is not None:
                if fault.errno in _AT_OPEN:
                    raise OSError(fault.errno, os.strerror(fault.errno), path)
                return _FailingWrites(real_open(file, mode, *args, **kwargs), fault.errno)
        return real_open(file, mode, *args, **kwargs)

    return open_


def patch_loop(loop: Any, injector: _Injector) -> None:
    """Wrap ``loop``'s (the module :data:`LOOP_MODULE`, or a stand-in with the same names)
    ``_train_step``, ``total_loss`` and step-end collective (``sync_flag``/``agree``) with the
    faults of ``injector``."""
    real_step, real_loss = loop._train_step, loop.total_loss

    @functools.wraps(real_step)
    def _train_step(fit, *args, **kwargs):
        step = fit.step + 1
        injector.step = step
        for f in injector.due(("exit", "raise", "kill", "stop"), step):
            if f.kind == "exit":
                os._exit(137)
            if f.kind in ("kill", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
                continue  # after a SIGCONT, a stopped rank trains on
            raise RuntimeError(f"injected fault: rank {injector.rank} step {step}")
        injector.in_step = True
        try:
            out = real_step(fit, *args, **kwargs)
        finally:
            injector.in_step = False
        if injector.ledger is not None:
            _write_ledger(injector, fit)
        return out

    @functools.wraps(real_loss)
    def total_loss(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if injector.in_step:  # not validation
            for f in injector.due(("nan", "spike", "inf_grad"), injector.step):
                loss = _inf_gradient(loss) if f.kind == "inf_grad" else \
                    loss * (float("nan") if f.kind == "nan" else f.factor)
        return loss

    loop._train_step, loop.total_loss = _train_step, total_loss
    for name in ("sync_flag", "agree"):  # the step-end collective (its name changed over time)
        real = getattr(loop, name, None)
        if real is not None:
            setattr(loop, name, _sleeping(real, injector))


def _inf_gradient(loss):
    """``loss`` unchanged in the forward pass; its gradient multiplied by +inf in the backward pass."""
    import torch

    class _InfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * float("inf")

    return _InfGrad.apply(loss)


def _weights_digest(engine) -> str:
    """SHA-256 of this rank's parameters in ``engine.module``'s order (a ZeRO-3 parameter's local
    partition, ``ds_tensor``, where it has one)."""
    h = hashlib.sha256()
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", p).detach().float().cpu().contiguous()
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _write_ledger(injector: _Injector, fit) -> None:
    """Append this rank's line for the step just trained (see the module doc) with one ``write``
    on an ``O_APPEND`` descriptor."""
    assert injector.ledger is not None
    verdict = getattr(fit, "verdict", None)
    line = json.dumps({"step": fit.step, "rank": injector.rank, "pid": os.getpid(),
                       "skipped": getattr(verdict, "skip", None), "weights": _weights_digest(fit.built.engine)})
    injector.ledger.mkdir(parents=True, exist_ok=True)
    fd = os.open(injector.ledger / f"rank{injector.rank}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class LedgerError(AssertionError):
    """The ledger shows a step trained in a way a resume must not allow (see :func:`check_ledger`)."""


def read_ledger(directory: str | os.PathLike) -> dict[int, list[dict]]:
    """The ledger of ``directory``: ``{rank: [its lines in the order written]}``."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        out[int(path.stem[4:])] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def check_ledger(ledger: dict[int, list[dict]], steps: int, checkpoints: Sequence[int] | None = None) -> dict[str, Any]:
    """Check that a run of several attempts (each a process per rank; a crash or a stop between
    them, each later attempt resumed from a checkpoint) trained every step 1..``steps`` exactly
    once on its final trajectory. Per rank, the attempts (runs of one pid) in order:

    * an attempt trains consecutive steps, each once: ``r + 1, r + 2, ..., e`` where ``r`` is the
      step it resumed from (0 for the first);
    * the next attempt resumes from ``r' <= e``: the steps ``r' + 1 .. e`` of this attempt were
      trained after the checkpoint the next one resumed from and are trained again (the one
      allowed repetition: the work a crash between checkpoints costs); a resume past ``e`` would
      leave steps out;
    * the kept steps (each attempt's ``r + 1 .. min(e, r')``, the last attempt's all) are 1..``steps``
      exactly once on every rank, and the ranks' attempts start at the same steps.

    ``checkpoints``: the newest complete checkpoint's step after each attempt but the last (what
    ``--resume auto`` must continue from); each later attempt must resume exactly there, so a
    resume from an older checkpoint, which re-trains more than the crash lost, fails. With the
    ``weights`` digests, a re-trained step must also give the weights its first training gave (a
    resume is exact). Returns the lowest rank's ``{"attempts": [(first, last) per attempt],
    "retrained": [steps trained again]}``; raises :class:`LedgerError` naming the step and the attempt."""
    if not ledger:
        raise LedgerError("the ledger is empty: no rank recorded a trained step")
    shapes: dict[int, dict[str, Any]] = {}
    for rank, lines in ledger.items():
        attempts: list[list[dict]] = []
        for line in lines:
            if not attempts or attempts[-1][-1]["pid"] != line["pid"]:
                attempts.append([])
            attempts[-1].append(line)
        kept: list[int] = []
        retrained: list[int] = []
        spans: list[tuple[int, int]] = []
        first_weights: dict[int, str | None] = {}
        resumed = 0
        for i, att in enumerate(attempts):
            got = [x["step"] for x in att]
            want = list(range(resumed + 1, resumed + 1 + len(got)))
            if got != want:
                raise LedgerError(f"rank {rank}, attempt {i + 1} (pid {att[0]['pid']}): trained steps {got}, not "
                                  f"{want[0]}..{want[-1]} once each after resuming from step {resumed}")
            end = got[-1]
            nxt = attempts[i + 1][0]["step"] - 1 if i + 1 < len(attempts) else end
            if checkpoints is not None and i + 1 < len(attempts) and nxt != checkpoints[i]:
                raise LedgerError(f"rank {rank}: attempt {i + 2} resumed from step {nxt}, not from the newest complete "
                                  f"checkpoint (step {checkpoints[i]}) attempt {i + 1} left")
            if nxt > end:
                raise LedgerError(f"rank {rank}: attempt {i + 2} resumed from step {nxt}, past the last step "
                                  f"{end} attempt {i + 1} trained: steps {end + 1}..{nxt} were never trained")
            for x in att:
                (kept if x["step"] <= nxt else retrained).append(x["step"])
                if x["step"] in first_weights and first_weights[x["step"]] != x.get("weights"):
                    raise LedgerError(f"rank {rank}: step {x['step']} trained again in attempt {i + 1} gave other "
                                      "weights than its first training: the resume is not exact")
                first_weights.setdefault(x["step"], x.get("weights"))
            spans.append((got[0], end))
            resumed = nxt
        if kept != list(range(1, steps + 1)):
            twice = sorted({s for s in kept if kept.count(s) > 1})
            missing = sorted(set(range(1, steps + 1)) - set(kept))
            raise LedgerError(f"rank {rank}: the final trajectory trained steps twice {twice} or missed {missing} "
                              f"(of 1..{steps})")
        shapes[rank] = {"attempts": spans, "retrained": retrained}
    # the ranks resume together (one checkpoint); the last step of a failed attempt may differ (a rank
    # killed between the end of its step and its ledger line)
    first_rank = min(shapes)
    starts = {rank: [a for a, _ in shape["attempts"]] for rank, shape in shapes.items()}
    for rank, st in starts.items():
        if st != starts[first_rank]:
            raise LedgerError(f"rank {rank}'s attempts start at steps {st}, rank {first_rank}'s at "
                              f"{starts[first_rank]}: the ranks disagree")
    return shapes[first_rank]


def _sleeping(real: Callable[..., Any], injector: _Injector) -> Callable[..., Any]:
    @functools.wraps(real)
    def collective(*args, **kwargs):
        for f in injector.due(("sleep",), injector.step):
            time.sleep(f.seconds)
        return real(*args, **kwargs)

    return collective


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that lets :data:`LOOP_MODULE` load as usual, then patches it."""

    def __init__(self, patch: Callable[[ModuleType], None]):
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != LOOP_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch: Callable[[ModuleType], None]):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install(faults: list[Fault], rank: int, ledger: str | os.PathLike | None = None) -> _Injector:
    """Inject ``faults`` into this process as rank ``rank``: patch :data:`LOOP_MODULE` now if it
    is imported, else when it is (an import hook); with a ``save_error`` of this rank, ``open``
    too (when the loop is patched); with ``ledger`` (a directory), keep the ledger there. Returns
    the injector (its ``fired`` set says what fired)."""
    injector = _Injector(faults, rank, Path(ledger) if ledger else None)

    def patch(loop: ModuleType) -> None:
        patch_loop(loop, injector)
        if any(f.kind == "save_error" for f in injector.faults):
            builtins.open = _failing_open(injector, builtins.open)

    if LOOP_MODULE in sys.modules:
        patch(sys.modules[LOOP_MODULE])
    else:
        sys.meta_path.insert(0, _PatchOnImport(patch))
    return injector


def install_from_env() -> _Injector | None:
    """``sitecustomize``'s call: :func:`install` the faults of ``SMELT_FAULTS`` and the ledger of
    ``SMELT_LEDGER`` as rank ``RANK`` (0 when unset) in a training process
    (:func:`is_training_process`). Nothing when both are unset or blank, or in another process (a
    launcher). Raises ValueError naming a
    bad spec."""
    text, ledger = os.environ.get(FAULTS_ENV, ""), os.environ.get(LEDGER_ENV, "")
    if not text.strip() and not ledger.strip():
        return None
    faults = parse_faults(text)
    if not is_training_process():
        return None
    return install(faults, int(os.environ.get("RANK", "0")), ledger.strip() or None)
