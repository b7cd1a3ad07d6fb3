"""``smelt-ds data tokenize``: documents -> a Megatron-LM indexed dataset (``PREFIX.bin`` +
``PREFIX.idx``) or a numpy ``.npy`` token file, the files ``megatron:`` and ``tokens:`` sources and
``smelt-ds data inspect`` read (Megatron-LM's ``tools/preprocess_data.py``, with the recipe's tokenizer).

**Documents** are read as ``data prepare`` reads a ``path`` source (:mod:`smelt_ds.data.sources`):
JSONL (one document per line, the string field ``json_key``), Parquet (the column ``json_key``) or
text (the whole file, or per paragraph or line: ``sample_by``), with the recipe's bad-input policies
(``data.bad_jsonl_lines``, ``data.non_utf8``, ``data.max_invalid_utf8_share``). Empty and
whitespace-only documents and blank lines are skipped and counted, as ``data prepare`` does (Megatron's
tool keeps an empty document as one of no tokens).

**Ids** are the document's own (:func:`smelt_ds.data.prepare._encode_batch`, as ``data prepare``):
``add_special_tokens=False`` (no BOS of a post-processor template) and special-token text inside a
document encoded as plain text; documents longer than ``data.tokenize_chunk_bytes`` are encoded in
pieces cut at whitespace (the same ids). With ``append_eod`` (the default, Megatron's
``--append-eod``) every document ends with the end-of-text id of ``data.tokenizer.eot_token``;
without it (Megatron format only) documents end where their text does, and training inserts the
separator. A ``.npy`` file is cut into documents at end-of-text ids, so it always has them.

**Files.** Megatron: one sequence per document, the dtype ``preprocess_data.py`` picks
(:func:`~smelt_ds.data.token_writers.megatron_dtype`: uint16 below 65,500 ids, else int32), the
index of :func:`~smelt_ds.data.token_writers.write_megatron_index`. ``.npy``: ``np.save``'s format,
uint16 or uint32 (:func:`~smelt_ds.data.token_writers.flat_dtype`).

**Workers and order.** The parent reads the documents in input order and groups them into chunks
of about ``chunk_bytes`` characters; ``workers`` processes (``spawn``) tokenise the chunks, each
with one tokenizer thread (TOKENIZERS_PARALLELISM=false), and the parent writes the results in
chunk order, so the output does not depend on the number of workers. ``workers=1`` tokenises in
this process.

**Interrupted runs continue.** Everything is written under ``<output>.tokenize-partial/``:
``tokens`` (the .bin, or the .npy with a header of 0 tokens), ``lengths`` (int32 tokens per
document, Megatron), ``state.json`` and ``lock``. After each chunk is written, ``state.json`` is
replaced (atomically) with the chunks, documents and tokens written so far and the run's settings
(input files' names, sizes and modification times, the tokenizer's sha256, the options). A rerun
with the same settings cuts the files back to the state's sizes (dropping a chunk cut short by the
interrupt) and continues with the next chunk; the result is byte for byte that of an uninterrupted
run. Other settings, or files shorter than the state says (a machine crash), start again from the
first document; the command says which. When the last chunk is written the index (or the .npy
header) is written, any old ``PREFIX.idx`` is removed, ``tokens`` is renamed to ``PREFIX.bin``
and the new index to ``PREFIX.idx`` last (``os.replace``, one file system): a ``.bin`` without its
``.idx`` is never read as a dataset, so a partial output is never taken for a complete one. A
``.npy`` is renamed into place whole. A second run on the same output while one runs is refused
(``flock`` on ``lock``). Bad input (:class:`ConfigError`) removes the partial directory; anything
else (Ctrl-C, SIGKILL, a full disk) leaves it to continue from.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing
import os
import shutil
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from smelt_ds.config.data import DataConfig, SourceConfig
from smelt_ds.data.prepare import _encode_batch, _tokenizers_parallelism_off
from smelt_ds.data.sources import _file_rows, resolve_files
from smelt_ds.data.token_files import megatron_prefix
from smelt_ds.data.token_writers import (
    NPY_HEADER_BYTES,
    flat_dtype,
    megatron_dtype,
    npy_header,
    write_megatron_index,
    write_npy_header,
)
from smelt_ds.data.tokenizer import cut_problem, special_ids, tokenizer_id_space, utf8_len
from smelt_ds.errors import ConfigError
from smelt_ds.files import relative_rule, write_json_atomic
from smelt_ds.runs.tokenizer_file import tokenizer_hash

__all__ = ["FORMATS", "DEFAULT_CHUNK_BYTES", "WORK_SUFFIX", "TokenizeResult", "tokenize_files", "output_files",
           "work_dir"]

FORMATS = ("megatron", "npy")
DEFAULT_CHUNK_BYTES = 1 << 22  # characters of text per chunk (about 1M tokens): the unit of work and of resuming
WORK_SUFFIX = ".tokenize-partial"
_STATE_VERSION = 1
_WHERE = "--input"


@dataclass
class TokenizeResult:
    """What :func:`tokenize_files` wrote: ``outputs`` (the .bin and .idx, or the .npy), ``dtype``,
    ``documents`` and ``tokens`` written (end-of-text ids included), ``skipped`` (items per reason),
    ``chunks`` (all of them), ``resumed_chunks`` (taken from an interrupted run) and
    ``restart_reason`` (why an interrupted run's files were not continued, else None)."""

    outputs: list[Path]
    format: str
    dtype: np.dtype
    eot_id: int
    documents: int
    tokens: int
    chunks: int
    resumed_chunks: int = 0
    restart_reason: str | None = None
    skipped: dict[str, int] = field(default_factory=dict)


def output_files(output: str | Path, fmt: str) -> list[Path]:
    """The files a run writes: ``[PREFIX.bin, PREFIX.idx]`` for ``megatron`` (``output`` is the
    prefix, or either file), ``[output]`` for ``npy``."""
    if fmt == "megatron":
        prefix = megatron_prefix(output)
        return [prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")]
    return [Path(output)]


def work_dir(output: str | Path, fmt: str) -> Path:
    """``<prefix or file>.tokenize-partial``: where a run writes until it renames its files into place."""
    base = megatron_prefix(output) if fmt == "megatron" else Path(output)
    return base.with_name(base.name + WORK_SUFFIX)


# --------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


_PARENT_POLL_S = 0.5  # seconds between a worker's looks at its parent


def _exit_with_parent(parent: int) -> None:
    """End this worker when its parent is gone (a killed parent leaves its pool's workers waiting
    on a queue that never closes, since each holds both ends of it)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)


def _init_worker(tokenizer_json: str, eot_id: int, max_bytes: int, append_eod: bool, dtype: str,
                 parent: int | None = None) -> None:
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    tok = Tokenizer.from_str(tokenizer_json)
    _WORKER.update(tok=tok, eot_id=eot_id, max_bytes=max_bytes, cut=cut_problem(tok), append_eod=append_eod,
                   dtype=np.dtype(dtype))


def _encode_chunk(first_document: int, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a chunk's documents back to back (the worker's dtype) and tokens per document
    (int64), end-of-text appended when asked (``first_document``: the 0-based number of the first
    one in input order, for errors)."""
    w = _WORKER
    rows = _encode_batch({"text": texts}, list(range(first_document, first_document + len(texts))), w["tok"],
                         w["eot_id"], w["max_bytes"], w["cut"], _WHERE)["input_ids"]
    drop = 0 if w["append_eod"] else 1  # _encode_batch always appends end-of-text
    parts = [np.asarray(r, dtype=np.int64)[:len(r) - drop] for r in rows]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    ids = np.concatenate(parts) if parts else np.empty(0, np.int64)
    top = np.iinfo(w["dtype"]).max
    if ids.size and (int(ids.max()) > top or int(ids.min()) < 0):
        raise ConfigError(f"token id {int(ids.max())} does not fit the output dtype {w['dtype'].name}: the tokenizer "
                          "produced an id beyond its vocabulary; use another tokenizer")
    return ids.astype(w["dtype"]), lengths


class _InProcess:
    """``submit`` of an executor that runs the call now, in this process (``workers=1``)."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f


@contextlib.contextmanager
def _executor(workers: int, init_args: tuple) -> Iterator[Any]:
    if workers == 1:
        _init_worker(*init_args)
        yield _InProcess()
        return
    with _tokenizers_parallelism_off(True), ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(*init_args, os.getpid())) as pool:
        try:
            yield pool
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


# --------------------------------------------------------------------------------------------
# input
# --------------------------------------------------------------------------------------------


def _input_files(inputs: list[str], glob: str) -> list[Path]:
    """The input files in order (a directory: its files matching ``glob``, sorted), each checked
    to be readable."""
    files: list[Path] = []
    for raw in inputs:
        p = Path(raw).expanduser()
        if not p.exists():
            raise ConfigError(f"--input {raw!r}: no such file or directory ({relative_rule(p)}): fix the path")
        files += resolve_files(SourceConfig(path=str(p), glob=glob), f"--input {raw!r}")
    for p in files:
        try:
            with open(p, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"--input file {str(p)!r} cannot be read ({e.strerror or e}): fix its permissions "
                              "(chmod a+r), or leave it out") from None
    return files


def _chunks(rows: Iterator[dict], chunk_chars: int, sizes: dict[str, tuple[int, int]], skipped: Counter
            ) -> Iterator[tuple[list[str], int]]:
    """Documents grouped into chunks of about ``chunk_chars`` characters, in order, each with the
    input position reached (bytes of ``sizes``' files before it, estimated within a file by the
    documents' UTF-8 bytes); skipped rows are counted in ``skipped`` by reason."""
    texts: list[str] = []
    chars, current, read = 0, "", 0
    for row in rows:
        if row["file"] != current:
            current, read = row["file"], 0
        before, size = sizes[current]
        if row["skip"]:
            skipped[row["skip"]] += 1
            continue
        texts.append(row["text"])
        chars += len(row["text"])
        read += utf8_len(row["text"]) + 1
        if chars >= chunk_chars:
            yield texts, before + min(size, read)
            texts, chars = [], 0
    if texts:
        yield texts, sum(s for _, s in sizes.values())


# --------------------------------------------------------------------------------------------
# the output and its partial directory
# --------------------------------------------------------------------------------------------


class _Output:
    """The partial directory of one output (see the module docstring): lock, state, resume, finish."""

    def __init__(self, output: str | Path, fmt: str, dtype: np.dtype, settings: dict):
        self.fmt, self.dtype, self.settings = fmt, dtype, settings
        self.finals = output_files(output, fmt)
        self.work = work_dir(output, fmt)
        self.tokens_path, self.lengths_path = self.work / "tokens", self.work / "lengths"
        self.index_path, self.state_path = self.work / "index", self.work / "state.json"
        self.header = NPY_HEADER_BYTES if fmt == "npy" else 0
        self._tokens: Any = None
        self._lengths: Any = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.work.mkdir(parents=True, exist_ok=True)
        lock = self.work / "lock"
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(f"{str(self.finals[0])!r}: another `smelt-ds data tokenize` is writing this output "
                                  f"now (it holds the lock {str(lock)!r}): wait for it to end, or stop it") from None
            yield
        finally:
            os.close(fd)

    def _expected(self, tokens: int, documents: int) -> tuple[int, int]:
        return self.header + tokens * self.dtype.itemsize, 4 * documents if self.fmt == "megatron" else 0

    def begin(self) -> tuple[int, int, int, str | None]:
        """``(chunks, documents, tokens)`` kept from an interrupted run (zeros when starting anew), and
        why an interrupted run's files were not kept (None when there were none, or they were)."""
        state = None
        if self.state_path.is_file():
            try:
                state = json.loads(self.state_path.read_text())
            except (OSError, ValueError):
                state = None
        reason = None
        if state is not None:
            if state.get("settings") != self.settings:
                reason = ("the inputs, the tokenizer or the options differ from those of the interrupted run "
                          f"(its state: {str(self.state_path)!r})")
            else:
                if state.get("finishing") and not self.tokens_path.exists() and self.finals[0].is_file():
                    os.replace(self.finals[0], self.tokens_path)  # killed while renaming: take the data back
                want_tokens, want_lengths = self._expected(state["tokens"], state["documents"])
                have_lengths = self.lengths_path.stat().st_size if self.lengths_path.is_file() else -1
                if (self.tokens_path.is_file() and self.tokens_path.stat().st_size >= want_tokens
                        and (self.fmt != "megatron" or have_lengths >= want_lengths)):
                    os.truncate(self.tokens_path, want_tokens)
                    if self.fmt == "megatron":
                        os.truncate(self.lengths_path, want_lengths)
                    self._open()
                    return int(state["chunks"]), int(state["documents"]), int(state["tokens"]), None
                reason = "its files are shorter than its state records (the machine stopped before they were written)"
        self._reset()
        return 0, 0, 0, reason

    def _reset(self) -> None:
        for p in (self.tokens_path, self.lengths_path, self.index_path, self.state_path):
            p.unlink(missing_ok=True)
        self.tokens_path.write_bytes(npy_header(self.dtype, 0) if self.fmt == "npy" else b"")
        self.lengths_path.write_bytes(b"")
        self._open()

    def _open(self) -> None:
        self._tokens = open(self.tokens_path, "ab")
        self._lengths = open(self.lengths_path, "ab")

    def append(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        self._tokens.write(ids.tobytes())
        if self.fmt == "megatron":
            if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
                raise ConfigError(f"a document of {int(lengths.max()):,} tokens: Megatron-LM's index holds at most "
                                  f"{np.iinfo(np.int32).max:,} tokens per sequence: split the document")
            self._lengths.write(lengths.astype("<i4").tobytes())

    def commit(self, chunks: int, documents: int, tokens: int, **extra: Any) -> None:
        self._tokens.flush()
        self._lengths.flush()
        write_json_atomic(self.state_path, {"version": _STATE_VERSION, "settings": self.settings, "chunks": chunks,
                                            "documents": documents, "tokens": tokens, **extra})

    def close(self) -> None:
        for f in (self._tokens, self._lengths):
            if f is not None:
                f.close()

    def finish(self, chunks: int, documents: int, tokens: int) -> None:
        """Write the index or header, then rename the files into place (the .idx last) and remove
        the partial directory."""
        self.commit(chunks, documents, tokens, finishing=True)
        for f in (self._tokens, self._lengths):
            os.fsync(f.fileno())
        self.close()
        if self.tokens_path.stat().st_size != self._expected(tokens, documents)[0]:
            raise RuntimeError(f"{self.tokens_path}: {self.tokens_path.stat().st_size} bytes, not "
                               f"{self._expected(tokens, documents)[0]} (internal error)")
        if self.fmt == "megatron":
            lengths = (np.memmap(self.lengths_path, dtype="<i4", mode="r") if documents
                       else np.empty(0, np.int32))
            write_megatron_index(self.index_path, self.dtype, lengths)
            del lengths
            self.finals[1].unlink(missing_ok=True)  # the old dataset's index first: never a new .bin with it
            os.replace(self.tokens_path, self.finals[0])
            os.replace(self.index_path, self.finals[1])
        else:
            write_npy_header(self.tokens_path, self.dtype, tokens)
            os.replace(self.tokens_path, self.finals[0])
        with contextlib.suppress(OSError):  # the renames on disk (where the file system allows it)
            fd = os.open(self.finals[0].parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        shutil.rmtree(self.work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar over the input bytes when ``stream`` is a terminal; otherwise one line per 10% of
    the input (log files, pipes, a scheduler's output). None: nothing."""

    def __init__(self, total: int, stream: TextIO | None):
        self.total, self.stream, self.next_tenth = max(1, total), stream, 1
        isatty = getattr(stream, "isatty", None)
        self.bar = (tqdm(total=self.total, unit="B", unit_scale=True, desc="tokenize", file=stream, dynamic_ncols=True)
                    if stream is not None and isatty is not None and isatty() else None)

    def update(self, position: int, documents: int, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(max(0, min(position, self.total) - self.bar.n))
            self.bar.set_postfix(documents=f"{documents:,}", tokens=f"{tokens:,}")
            return
        tenth = 10 * min(position, self.total) // self.total
        if self.stream is not None and tenth >= self.next_tenth:
            self.next_tenth = tenth + 1
            print(f"smelt-ds data tokenize: {10 * tenth}% of the input ({documents:,} documents, {tokens:,} tokens)",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def tokenize_files(data: DataConfig, tokenizer: Tokenizer, inputs: list[str], output: str | Path,
                   fmt: str = "megatron", json_key: str = "text", input_format: str = "auto",
                   sample_by: str = "document", glob: str = "**/*", append_eod: bool = True, workers: int = 1,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: TextIO | None = None) -> TokenizeResult:
    """Tokenise the documents of ``inputs`` into ``output`` (see the module docstring).

    Args:
        data: the recipe's data section: ``tokenizer.eot_token`` / ``pad_token`` (both must be tokens
            of ``tokenizer``), ``bad_jsonl_lines``, ``non_utf8``, ``max_invalid_utf8_share``,
            ``tokenize_chunk_bytes``.
        tokenizer: the tokenizer (``tokenizers.Tokenizer``).
        inputs: files or directories (their files matching ``glob``, sorted), read in order.
        output: the Megatron prefix (or its .bin / .idx), or the ``.npy`` file.
        fmt: ``megatron`` or ``npy``.
        json_key: the JSONL field / Parquet column holding the text.
        input_format, sample_by: as a source's ``format`` and ``sample_by``.
        append_eod: end every document with the end-of-text id (required for ``npy``).
        workers: tokenising processes (1: this process).
        chunk_bytes: characters of text per chunk, the unit of work and of resuming.
        progress: where the progress bar or lines and the resume message go (None: nowhere).

    Returns a :class:`TokenizeResult`. Raises ConfigError for a bad option, a missing, empty or
    unreadable input, a bad line or file (naming file and line, and the field), a tokenizer without
    the end-of-text token, or inputs without any document.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: not one of {', '.join(FORMATS)}")
    if fmt == "npy" and not append_eod:
        raise ConfigError("--no-append-eod with --format npy: a flat token file's documents are cut at end-of-text "
                          "ids, so every document must end with one: drop --no-append-eod, or write --format megatron")
    if workers < 1 or chunk_bytes < 1:
        raise ConfigError(f"--workers ({workers}) and --chunk-bytes ({chunk_bytes}) must be at least 1")
    eot_id, _ = special_ids(tokenizer, data.tokenizer)
    id_space = tokenizer_id_space(tokenizer)
    dtype = megatron_dtype(id_space) if fmt == "megatron" else flat_dtype(id_space)
    files = _input_files(inputs, glob)
    src = SourceConfig(path=str(files[0]), text_field=json_key, format=input_format, sample_by=sample_by)
    stats = [os.stat(p) for p in files]
    settings = {"inputs": [[str(p.resolve()), st.st_size, st.st_mtime_ns] for p, st in zip(files, stats, strict=True)],
                "tokenizer": tokenizer_hash(tokenizer), "eot_id": eot_id, "format": fmt, "dtype": dtype.name,
                "source": src.model_dump(mode="json", include={"text_field", "format", "sample_by"}),
                "append_eod": append_eod, "chunk_bytes": chunk_bytes,
                "data": data.model_dump(mode="json", include={"bad_jsonl_lines", "non_utf8", "max_invalid_utf8_share",
                                                              "tokenize_chunk_bytes"})}
    sizes, before = {}, 0
    for p, st in zip(files, stats, strict=True):
        sizes[str(p)] = (before, st.st_size)
        before += st.st_size
    out = _Output(output, fmt, dtype, settings)
    out.finals[0].parent.mkdir(parents=True, exist_ok=True)
    with out.locked():
        try:
            return _run(out, data, tokenizer, files, src, sizes, eot_id, append_eod, workers, chunk_bytes, progress)
        except ConfigError:
            out.close()
            shutil.rmtree(out.work, ignore_errors=True)  # bad input: nothing to continue from
            raise
        finally:
            out.close()


def _run(out: _Output, data: DataConfig, tokenizer: Tokenizer, files: list[Path], src: SourceConfig,
         sizes: dict[str, tuple[int, int]], eot_id: int, append_eod: bool, workers: int, chunk_bytes: int,
         progress: TextIO | None) -> TokenizeResult:
    done, documents, tokens, reason = out.begin()
    if progress is not None and (done or reason):
        said = (f"continuing the interrupted run in {str(out.work)!r}: {done:,} chunks ({documents:,} documents, "
                f"{tokens:,} tokens) kept" if done else f"starting again: {reason}")
        print(f"smelt-ds data tokenize: {said}", file=progress, flush=True)
    kept_documents = documents
    skipped: Counter = Counter()
    rows = _file_rows([str(p) for p in files], src.model_dump_json(), data.model_dump_json(), "", _WHERE)
    bar = _Progress(sum(s for _, s in sizes.values()), progress)
    init = (tokenizer.to_str(), eot_id, data.tokenize_chunk_bytes, append_eod, out.dtype.name)
    pending: deque[tuple[Future, int]] = deque()
    written, read_documents = done, 0

    def write_one() -> None:
        nonlocal documents, tokens, written
        future, position = pending.popleft()
        ids, lengths = future.result()
        out.append(ids, lengths)
        documents, tokens, written = documents + len(lengths), tokens + len(ids), written + 1
        out.commit(written, documents, tokens)
        bar.update(position, documents, tokens)

    chunks = 0
    try:
        with _executor(workers, init) as pool:
            for texts, position in _chunks(rows, chunk_bytes, sizes, skipped):
                chunks += 1
                if chunks <= done:  # written by the interrupted run
                    read_documents += len(texts)
                    bar.update(position, read_documents, tokens)
                    continue
                pending.append((pool.submit(_encode_chunk, read_documents, texts), position))
                read_documents += len(texts)
                while len(pending) >= 2 * workers:  # a bounded number of chunks in flight
                    write_one()
            while pending:
                write_one()
    finally:
        bar.close()
    if chunks < done:
        raise ConfigError(f"{str(out.work)!r}: the interrupted run's state records {done} chunks ({kept_documents:,} "
                          f"documents), the inputs now give {chunks}: it is removed; run the command again")
    if documents == 0:
        raise ConfigError(f"--input {', '.join(str(p) for p in files)}: no documents (skipped: "
                          f"{dict(skipped) or 'nothing'}): check the files, --input-format and --json-key "
                          f"({src.text_field!r})")
    out.finish(chunks, documents, tokens)
    return TokenizeResult(out.finals, out.fmt, out.dtype, eot_id, documents, tokens, chunks, done, reason,
                          dict(skipped))
