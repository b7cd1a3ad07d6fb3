"""Reading sources into ``datasets.Dataset`` objects of documents (one ``text`` column).

Local files are read by a generator (``Dataset.from_generator``, written as Arrow under a working
directory) that yields one row per document *and one row per skipped item* with the reason, so
every skip is counted from the data itself: ``empty_document`` (whitespace only), ``empty_file``
(0 bytes, inside a directory), ``blank_line`` (JSONL), ``bad_jsonl_line`` (not JSON, not an
object, or the text field missing / not a string; only with ``bad_jsonl_lines: skip``). Invalid
UTF-8 byte sequences are replaced by U+FFFD and counted (``non_utf8: replace``) or stop the run
naming file, line and byte offset (``non_utf8: error``). A text-format file (not JSONL or Parquet)
that holds a NUL byte, or whose invalid UTF-8 bytes are more than ``max_invalid_utf8_share`` of its
bytes, is refused: it is a binary file or another encoding, and replacing would train on noise.
A document longer than ``tokenize_chunk_bytes`` that cannot be cut into pieces for the tokenizer
(no whitespace between non-whitespace characters for that long) is refused, naming file and line.

Dataset sources go through ``datasets.load_dataset``. Offline (``offline: true`` or
``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``SMELT_DS_OFFLINE`` set) turns on the offline mode
of ``datasets`` and ``huggingface_hub`` for the call, so a name missing from the local cache fails
at once with a clear message instead of retrying network requests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow.compute as pc
import pyarrow.parquet as pq

from smelt_ds.config.data import NEW_KIND_FIELDS, TOKEN_FIELDS, DataConfig, SourceConfig
from smelt_ds.data.builtin import builtin_corpus_dir, builtin_key
from smelt_ds.data.cache import sha256_json
from smelt_ds.data.ladder import ladder_corpus_dir, ladder_key
from smelt_ds.data.token_sources import token_source_files
from smelt_ds.data.tokenizer import UncuttableDocument, cut_document, utf8_len
from smelt_ds.errors import ConfigError
from smelt_ds.files import relative_rule

if TYPE_CHECKING:
    import datasets

__all__ = ["SourceData", "read_source", "read_sources", "source_fingerprint", "offline_requested",
           "resolve_files", "file_format"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
SKIP_REASONS = ("empty_document", "empty_file", "blank_line", "bad_jsonl_line")
def _row_features() -> datasets.Features:
    """The columns of a source's rows (``datasets`` is imported on first use: a training rank that
    opens a finished preparation never needs it)."""
    import datasets

    return datasets.Features({"text": datasets.Value("string"), "skip": datasets.Value("string"),
                              "file": datasets.Value("string"), "replaced": datasets.Value("int64")})
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_LINE_BREAK = re.compile(r"\r?\n")
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "SMELT_DS_OFFLINE")


@dataclass
class SourceData:
    """The documents of one source and what happened while reading them.

    ``dataset`` has one ``text`` column, one row per kept document. ``report`` counts
    ``files``, ``documents`` (kept), ``skipped`` (per reason, items) and ``replaced_invalid_utf8``
    (invalid byte sequences replaced by U+FFFD).
    """

    index: int
    config: SourceConfig
    domain: str
    dataset: datasets.Dataset
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"data.sources[{self.index}] ({self.config.label()})"


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------


def resolve_files(src: SourceConfig, where: str) -> list[Path]:
    """Files of a ``path`` source in sorted order. Raises ConfigError for a missing path,
    an explicit empty file, or a directory without matching files."""
    path = Path(cast(str, src.path)).expanduser()  # a path source (DataConfig checks the kind)
    if not path.exists():
        raise ConfigError(f"`{where}.path` ({src.path!r}): no such file or directory ({relative_rule(path)}): fix "
                          "the path or remove the source")
    if path.is_file():
        if path.stat().st_size == 0:
            raise ConfigError(f"`{where}.path` ({src.path!r}): the file is empty (0 bytes): "
                              "point the source at a file with documents or remove it")
        return [path]
    files = sorted(p for p in path.glob(src.glob)
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"`{where}.path` ({src.path!r}): the directory has no files matching "
                          f"glob {src.glob!r}: fix `{where}.glob` or the path")
    return files


def file_format(path: Path, fmt: str) -> str:
    """``text``, ``jsonl`` or ``parquet`` for ``path`` (``fmt`` unless it is ``auto``)."""
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSONL_SUFFIXES else "parquet" if suffix in PARQUET_SUFFIXES else "text"


def _decode(raw: bytes, policy: str, where: str, line_base: int = 1) -> tuple[str, int]:
    """UTF-8 text of ``raw`` and the number of invalid byte sequences replaced by U+FFFD."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if policy == "error":
            line = line_base + raw[:e.start].count(b"\n")
            raise ConfigError(f"{where} line {line} (byte {e.start} of the line/file): invalid UTF-8 byte "
                              f"{raw[e.start:e.start + 1]!r}: set data.non_utf8=replace to replace and count "
                              "such bytes, or convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    text = raw.decode("utf-8", "replace")
    return text, text.count("\ufffd") - raw.count("\ufffd".encode())


def _check_cuttable(doc: str, max_bytes: int, where: Callable[..., str]) -> None:
    """Refuse a document longer than ``max_bytes`` that cannot be cut into pieces for the tokenizer
    (see :func:`smelt_ds.data.tokenizer.cut_document`); ``where()`` names it (``...``: callers pass
    ``lambda i=i: ...``, whose default argument mypy cannot match to ``Callable[[], str]``)."""
    if len(doc) > max_bytes // 4 and utf8_len(doc) > max_bytes:
        try:
            cut_document(doc, max_bytes)
        except UncuttableDocument as e:
            raise ConfigError(f"{where()}: {e}") from None


def _text_row(text: str | None, file: str, skip: str = "", replaced: int = 0) -> dict:
    return {"text": text, "skip": skip, "file": file, "replaced": replaced}


def _split_text(text: str, sample_by: str) -> list[str]:
    if sample_by == "document":
        return [text]
    if sample_by == "paragraph":
        return _PARAGRAPH_BREAK.split(text)
    return _LINE_BREAK.split(text)


def _invalid_utf8_bytes(raw: bytes) -> int:
    """Bytes of ``raw`` that belong to no valid UTF-8 sequence."""
    return len(raw) - len(raw.decode("utf-8", "ignore").encode("utf-8"))


def _refuse_binary(raw: bytes, path: Path, policy: str, max_invalid_share: float) -> None:
    """ConfigError for a text-format file that holds a NUL byte, or (``non_utf8: replace``) whose
    invalid UTF-8 bytes are more than ``max_invalid_share`` of its bytes: binary or another encoding."""
    nul = raw.count(b"\x00")
    bad = 0
    if nul or policy == "replace":
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            bad = _invalid_utf8_bytes(raw)
    share = f"{bad:,} of {len(raw):,} bytes ({100 * bad / len(raw):.1f}%) are not valid UTF-8"
    where = f"file {str(path)!r}"
    if nul:
        raise ConfigError(f"{where}: {nul:,} NUL byte(s) in {len(raw):,} bytes" + (f", and {share}" if bad else "")
                          + ": this is not text (a text file has no NUL byte; UTF-16 text has one in every other "
                          "byte): remove it from the source (e.g. a narrower `glob` such as '**/*.txt') or convert "
                          "it to UTF-8 (e.g. iconv -f utf-16 -t utf-8)")
    if bad > max_invalid_share * len(raw):
        raise ConfigError(f"{where}: {share}, more than data.max_invalid_utf8_share ({max_invalid_share}): this is "
                          "not UTF-8 text (a binary file, or another encoding): remove it from the source (e.g. a "
                          "narrower `glob` such as '**/*.txt'), convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), "
                          "or raise data.max_invalid_utf8_share to replace and count such bytes")


def _text_rows(path: Path, src: SourceConfig, cfg: DataConfig, where: str) -> Iterator[dict]:
    raw = path.read_bytes()
    _refuse_binary(raw, path, cfg.non_utf8, cfg.max_invalid_utf8_share)
    text, replaced = _decode(raw, cfg.non_utf8, f"file {str(path)!r}")
    del raw
    for i, doc in enumerate(_split_text(text, src.sample_by)):
        _check_cuttable(doc, cfg.tokenize_chunk_bytes,
                        lambda i=i: f"{where} file {str(path)!r} {src.sample_by} {i + 1}")
        # the replaced count goes on the first row of the file so the total is exact
        yield _text_row(doc, str(path), "" if doc.strip() else "empty_document", replaced if i == 0 else 0)


def _jsonl_error(path: Path, lineno: int, problem: str, field_name: str) -> ConfigError:
    return ConfigError(f"file {str(path)!r} line {lineno}: {problem}: fix the line, or set "
                       f"data.bad_jsonl_lines=skip to skip and count such lines (text field: {field_name!r})")


def _jsonl_line(line: bytes, lineno: int, path: Path, src: SourceConfig, cfg: DataConfig, where: str) -> dict:
    text, replaced = _decode(line, cfg.non_utf8, f"file {str(path)!r}", lineno)
    if not text.strip():
        return _text_row(None, str(path), "blank_line", replaced)
    try:
        obj = json.loads(text)
        problem = (None if isinstance(obj, dict) and isinstance(obj.get(src.text_field), str)
                   else f"JSON {type(obj).__name__} without a string field {src.text_field!r}")
    except json.JSONDecodeError as e:
        problem = f"not valid JSON ({e.msg} at column {e.colno})"
    if problem is None:
        doc = obj[src.text_field]
        _check_cuttable(doc, cfg.tokenize_chunk_bytes, lambda: f"{where} file {str(path)!r} line {lineno}")
        return _text_row(doc, str(path), "" if doc.strip() else "empty_document", replaced)
    if cfg.bad_jsonl_lines == "error":
        raise _jsonl_error(path, lineno, problem, src.text_field)
    return _text_row(None, str(path), "bad_jsonl_line", replaced)


def _jsonl_rows(path: Path, src: SourceConfig, cfg: DataConfig, where: str) -> Iterator[dict]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            yield _jsonl_line(line, lineno, path, src, cfg, where)


def _parquet_rows(path: Path, src: SourceConfig, cfg: DataConfig, where: str) -> Iterator[dict]:
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if src.text_field not in names:
        raise ConfigError(f"file {str(path)!r}: no column {src.text_field!r} (columns: {names}): "
                          "set the source's text_field to the column holding the text")
    row = -1
    for batch in pf.iter_batches(columns=[src.text_field], batch_size=4096):
        for doc in batch.column(0).to_pylist():
            row += 1
            if doc is not None and not isinstance(doc, str):
                raise ConfigError(f"file {str(path)!r}: column {src.text_field!r} holds "
                                  f"{type(doc).__name__}, not text: choose a string column as text_field")
            if doc is not None:
                _check_cuttable(doc, cfg.tokenize_chunk_bytes,
                                lambda row=row: f"{where} file {str(path)!r} row {row} (0-based)")
            yield _text_row(doc, str(path), "" if doc and doc.strip() else "empty_document")


def _file_rows(files: list[str], src_json: str, cfg_json: str, fingerprint: str, where: str) -> Iterator[dict]:
    """Generator for ``Dataset.from_generator`` (arguments are plain data so they hash stably)."""
    src, cfg = SourceConfig.model_validate_json(src_json), DataConfig.model_validate_json(cfg_json)
    kept = 0
    for name in files:
        path = Path(name)
        if path.stat().st_size == 0:
            yield _text_row(None, name, "empty_file")
            continue
        fmt = file_format(path, src.format)
        rows = (_jsonl_rows(path, src, cfg, where) if fmt == "jsonl" else _parquet_rows(path, src, cfg, where)
                if fmt == "parquet" else _text_rows(path, src, cfg, where))
        for row in rows:
            yield row
            kept += row["skip"] == ""
            if src.max_documents is not None and kept >= src.max_documents:
                return


# --------------------------------------------------------------------------------------------
# fingerprints (the files' names, sizes and modification times, not their paths; no content read)
# --------------------------------------------------------------------------------------------

#: source fields that say where files are: not part of a fingerprint, so the same files under
#: another mount (a Kubernetes pod's volume) give the same preparation key
LOCATION_FIELDS = ("path", "megatron", "tokens")


def _file_list(files: list[Path]) -> list[tuple[str, int, int]]:
    """``(file name, size, modification time in ns)`` per file, in order, as ``make`` and
    ``rsync`` identify files: the same wherever one filesystem is mounted (and after a copy that
    keeps times: ``rsync -a``, ``tar``, ``cp -p``). The content is checked when a preparation is
    opened (a sampled sha256 per file: :func:`smelt_ds.data.token_sources.verify_token_files`);
    a file changed in place with its size and time kept is refused there, not prepared again
    behind a checkpoint's back."""
    out = []
    for p in files:
        st = p.stat()
        out.append((p.name, st.st_size, st.st_mtime_ns))
    return out


def source_fingerprint(src: SourceConfig, index: int, cfg: DataConfig) -> str:
    """Identity of a source for cache keys: its settings except where its files are, plus, for
    files (token files too), each file's name, size and modification time, for the built-in
    corpus the interpreter identity and cap, for a dataset name its name/config/split/revision (pin
    ``revision`` to notice upstream changes), for the ladder corpus its pinned files and cap
    (:func:`smelt_ds.data.ladder.ladder_key`). The same files under another path (a login node
    and the pods of a Kubernetes job mount one volume at different places) give the same key."""
    # fields added later are left out while unset: the keys of other sources stay what they were
    unset_later_fields = {k for k in TOKEN_FIELDS + NEW_KIND_FIELDS if getattr(src, k) is None}
    parts: dict[str, Any] = {"source": src.model_dump(mode="json", exclude=unset_later_fields | set(LOCATION_FIELDS)),
                             "kind": src.kind(), "domain": src.resolved_domain()}
    where = f"data.sources[{index}]"
    if src.is_token_source():
        parts["files"] = _file_list(token_source_files(src, where))
    elif src.path is not None:
        parts["files"] = _file_list(resolve_files(src, where))
    elif src.builtin is not None:
        parts["builtin"] = builtin_key(cfg.builtin_max_bytes)
    elif src.ladder is not None:
        parts["ladder"] = ladder_key(cfg.ladder_max_bytes)
    elif Path(cast(str, src.dataset)).expanduser().is_dir():  # neither path nor builtin: a dataset source
        parts["files"] = _file_list(sorted(p for p in Path(cast(str, src.dataset)).expanduser().rglob("*")
                                              if p.is_file()))
    return sha256_json(parts)


# --------------------------------------------------------------------------------------------
# dataset sources
# --------------------------------------------------------------------------------------------


def offline_requested(cfg: DataConfig) -> bool:
    """``cfg.offline`` or one of HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / SMELT_DS_OFFLINE set true."""
    env = any(os.environ.get(k, "").strip().upper() in {"1", "ON", "YES", "TRUE"} for k in _OFFLINE_ENV)
    return cfg.offline or env


@contextlib.contextmanager
def _hub_offline(on: bool):
    """Offline mode of datasets and huggingface_hub for the duration (they read env at import)."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    if on:
        datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _load_hub_dataset(src: SourceConfig, where: str, offline: bool) -> datasets.Dataset:
    import datasets

    try:
        with _hub_offline(offline):
            ds = datasets.load_dataset(src.dataset, src.dataset_config, split=src.split, revision=src.revision)
    except (ConnectionError, FileNotFoundError, OSError) as e:
        mode = "offline mode is on" if offline else "the Hub could not be reached"
        raise ConfigError(f"`{where}.dataset` ({src.dataset!r}): not found in the local datasets cache "
                          f"({datasets.config.HF_DATASETS_CACHE}) and {mode} ({type(e).__name__}: {e}): "
                          "download it once on a machine with network (it is then cached), "
                          "or use a local `path` source") from None
    except ValueError as e:  # e.g. unknown split or config name
        raise ConfigError(f"`{where}` ({src.label()}): load_dataset failed: {e}: "
                          "fix dataset_config / split") from None
    if src.text_field not in ds.column_names:
        raise ConfigError(f"`{where}.text_field` ({src.text_field!r}): dataset {src.dataset!r} has columns "
                          f"{ds.column_names}: set text_field to the column holding the text")
    return ds


def _hub_rows(batch: dict, indices: list[int], text_field: str, name: str, where: str, max_bytes: int) -> dict:
    texts = batch[text_field]
    for i, t in zip(indices, texts, strict=True):
        if isinstance(t, str):
            _check_cuttable(t, max_bytes, lambda i=i: f"{where} dataset {name!r} row {i} (0-based)")
    skip = ["" if isinstance(t, str) and t.strip() else "empty_document" for t in texts]
    return {"text": texts, "skip": skip, "file": [name] * len(texts), "replaced": [0] * len(texts)}


def _dataset_rows(src: SourceConfig, where: str, cfg: DataConfig, work_dir: Path, index: int) -> datasets.Dataset:
    ds = _load_hub_dataset(src, where, offline_requested(cfg))
    return ds.map(_hub_rows, batched=True, with_indices=True,
                  fn_kwargs={"text_field": src.text_field, "name": src.dataset, "where": where,
                             "max_bytes": cfg.tokenize_chunk_bytes},
                  remove_columns=ds.column_names, features=_row_features(),
                  cache_file_name=str(work_dir / f"rows-{index}.arrow"), desc=f"read {src.label()}")


# --------------------------------------------------------------------------------------------
# all sources
# --------------------------------------------------------------------------------------------


def _count(rows: datasets.Dataset) -> tuple[Counter, int]:
    """Rows per skip reason ("" = kept) and the total of replaced byte sequences."""
    table = rows.data.table
    counts = pc.value_counts(table.column("skip")).to_pylist()
    replaced = pc.sum(table.column("replaced")).as_py() or 0
    return Counter({c["values"]: c["counts"] for c in counts}), int(replaced)


def _kept(rows: datasets.Dataset, max_documents: int | None) -> datasets.Dataset:
    kept = rows.filter(lambda skip: [s == "" for s in skip], input_columns="skip", batched=True,
                       batch_size=65536, keep_in_memory=True)
    if max_documents is not None and len(kept) > max_documents:
        kept = kept.select(range(max_documents))
    return kept.select_columns(["text"])


def _local_rows(src: SourceConfig, files: list[Path], cfg: DataConfig, work_dir: Path, fp: str,
                where: str) -> datasets.Dataset:
    import datasets
    from datasets.exceptions import DatasetGenerationError

    kwargs = {"files": [str(p) for p in files], "src_json": src.model_dump_json(),
              "cfg_json": cfg.model_dump_json(), "fingerprint": fp, "where": where}
    try:
        return datasets.Dataset.from_generator(_file_rows, features=_row_features(), gen_kwargs=kwargs,
                                               cache_dir=str(work_dir / "generator"))
    except DatasetGenerationError as e:  # datasets wraps what the generator raised
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise


def read_source(src: SourceConfig, index: int, cfg: DataConfig, work_dir: Path,
                cache_dir: str | Path | None = None) -> SourceData:
    """Read one source into a :class:`SourceData` (Arrow files under ``work_dir``).

    Raises ConfigError for a missing path, an explicit empty file, a dataset that cannot be
    loaded, a bad JSONL line or invalid UTF-8 (under the ``error`` policies), or a source without
    any document.
    """
    where = f"data.sources[{index}]"
    fp = source_fingerprint(src, index, cfg)
    files: list[str] | list[Path]
    if src.dataset is not None:
        rows, files = _dataset_rows(src, where, cfg, work_dir, index), [src.dataset]
    else:
        local = src
        if src.builtin is not None:
            corpus = builtin_corpus_dir(cache_dir, cfg.builtin_max_bytes)
            local = src.model_copy(update={"builtin": None, "path": str(corpus / f"{src.builtin}.jsonl"),
                                           "format": "jsonl", "domain": src.resolved_domain()})
        elif src.ladder is not None:
            corpus = ladder_corpus_dir(cache_dir, cfg.ladder_max_bytes, cfg.ladder_packages_dir)
            local = src.model_copy(update={"ladder": None, "path": str(corpus / f"{src.ladder}.jsonl"),
                                           "format": "jsonl", "domain": src.resolved_domain()})
        files = resolve_files(local, where)
        rows = _local_rows(local, files, cfg, work_dir, fp, where)
    skips, replaced = _count(rows)
    kept = _kept(rows, src.max_documents)
    if len(kept) == 0:
        raise ConfigError(f"`{where}` ({src.label()}): no documents (read {len(files)} file(s); skipped "
                          f"{dict((k, v) for k, v in skips.items() if k)}): check the path, format and text_field")
    report = {"files": len(files), "documents": len(kept), "replaced_invalid_utf8": replaced,
              "skipped": {r: skips.get(r, 0) for r in SKIP_REASONS}, "fingerprint": fp}
    return SourceData(index, src, src.resolved_domain(), kept, report)


def read_sources(cfg: DataConfig, work_dir: Path, cache_dir: str | Path | None = None) -> list[SourceData]:
    """All text sources of ``cfg`` in order (see :func:`read_source`); token sources are not read here
    (:mod:`smelt_ds.data.token_sources`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    return [read_source(src, i, cfg, work_dir, cache_dir) for i, src in enumerate(cfg.sources)
            if not src.is_token_source()]
