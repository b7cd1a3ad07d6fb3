"""Token sources (``megatron``, ``tokens``): prepared in place, read as packed streams.

Nothing is tokenised or copied. Preparing a token source scans its files once
(:mod:`smelt_ds.data.token_files`: ids, documents, a key per document) and writes, per split, a
*stream index* of the documents of that split in file order::

    streams/<split>-s<SS>-starts.npy       int64 (n,): token offset of each document in its file
    streams/<split>-s<SS>-offsets.npy      int64 (n + 1,): where each document starts in the stream
    streams/<split>-s<SS>-file_first.npy   int64 (files + 1,): first document of each file

The *packed stream* of a split is its documents' contents back to back, each followed by exactly
one end-of-text id (a document's own trailing one is its separator; none is doubled, one is
inserted where it is missing), like the shards of text sources. It is cut into virtual shards of
at most ``data.shard_max_tokens`` tokens (records in ``meta.json`` with ``stream`` and
``offset``), so the loaders' windows, order, rank sharding and resume work on them unchanged:
:meth:`PreparedData.tokens <smelt_ds.data.prepare.PreparedData.tokens>` returns a
:class:`PackedTokens` that reads a range through memory maps of the user's files.

The split takes the documents with the smallest keys (:func:`~smelt_ds.data.token_files.content_keys`:
content length, first 48 and last 16 ids, keyed by ``data.seed``) for validation, as text sources
take the smallest hash of their text: the same documents in other files, in another order or
dtype, give the same split. The selection runs in two chunked passes
(:func:`~smelt_ds.data.token_files.select_smallest`), never holding all keys.

The manifest (``meta.json`` ``token_files``) identifies each user file by path, size, modification
time and the sha256 of a bounded sample (:func:`~smelt_ds.data.cache.sha256_sample`, 1 MiB), and
records its documents, tokens and id range: the largest id is checked against the tokenizer when
preparing and against ``model.vocab_size`` before training, without reading the files again.
Before the queue, ``smelt-ds preflight`` and ``render-job`` check the same on the files themselves
(:func:`check_source_ids`: every id up to :data:`PREFLIGHT_SCAN_TOKENS`, a sample beyond).
"""

from __future__ import annotations

import glob
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from smelt_ds.config.data import DataConfig, SourceConfig
from smelt_ds.data.cache import sha256_file, sha256_sample
from smelt_ds.data.token_files import (
    ID_SAMPLE_WINDOWS,
    ScanStats,
    TokenFile,
    content_keys,
    documents,
    megatron_pair,
    megatron_prefix,
    open_flat,
    open_megatron,
    scan_ids,
    select_smallest,
)
from smelt_ds.data.tokenizer import tokenizer_id_space
from smelt_ds.errors import ConfigError
from smelt_ds.files import relative_rule
from smelt_ds.runs.tokenizer_file import load_tokenizer

__all__ = ["TOKEN_SPLIT_SCHEME", "resolve_token_paths", "token_source_files", "open_token_path", "scan_source",
           "SourceScan", "write_source", "PackedStream", "PackedTokens", "TokenFileChanged", "verify_token_files",
           "open_any", "inspect_file", "check_ids", "check_token_file_ids", "check_eot", "relocate_token_files",
           "TokenFilesNotFound", "check_source_ids", "PREFLIGHT_SCAN_TOKENS"]

TOKEN_SPLIT_SCHEME = "token-key-v1"  # in the preparation key of recipes with token sources
_GLOB_CHARS = re.compile(r"[*?\[]")
_OPEN_FILES = 64  # memory maps kept open per stream (least recently used closed first)
_WRITE_DOCS = 1 << 20  # documents routed to the split indexes at once
#: token ids that :func:`check_source_ids` reads at most for a recipe (2^28: 512 MiB of uint16)
PREFLIGHT_SCAN_TOKENS = 1 << 28


# --------------------------------------------------------------------------------------------
# which files
# --------------------------------------------------------------------------------------------


def _visible(root: Path, p: Path) -> bool:
    return p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)


def resolve_token_paths(src: SourceConfig, where: str) -> list[Path]:
    """The files of a token source in sorted order: Megatron prefixes (``megatron``) or token
    files (``tokens``). A value with ``*``, ``?`` or ``[`` is a glob pattern; a directory gives
    its files matching ``glob`` (for ``megatron``, its ``.idx`` files). Raises ConfigError naming
    ``where`` when nothing matches."""
    kind = src.kind()
    value = str(getattr(src, kind))
    path = Path(value).expanduser()
    if _GLOB_CHARS.search(value):
        found = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
    elif path.is_dir():
        found = sorted(p for p in path.glob(src.glob) if _visible(path, p))
    else:
        found = [path] if (path.is_file() or kind == "megatron") else []
    if kind == "megatron":
        prefixes = [megatron_prefix(p) for p in found if p.suffix in (".idx", ".bin") or not path.is_dir()]
        found = [p for p in dict.fromkeys(prefixes) if p.with_name(p.name + ".idx").is_file()]
    if not found:
        what = "Megatron .idx/.bin pair" if kind == "megatron" else "token file"
        raise ConfigError(f"`{where}.{kind}` ({value!r}): no {what} there ({relative_rule(value)}): fix "
                          f"the path{', the pattern' if _GLOB_CHARS.search(value) else ''} or `{where}.glob`, or "
                          "remove the source")
    return found


def token_source_files(src: SourceConfig, where: str) -> list[Path]:
    """Every file a token source reads (for a Megatron pair: the .idx, then the .bin)."""
    paths = resolve_token_paths(src, where)
    if src.kind() != "megatron":
        return paths
    return [f for p in paths for f in megatron_pair(p)]


def open_token_path(path: Path, src: SourceConfig, where: str) -> TokenFile:
    """Open one file of a token source (headers and sizes checked)."""
    if src.kind() == "megatron":
        return open_megatron(path)
    return open_flat(path, src.token_dtype, f"{where}.token_dtype")


# --------------------------------------------------------------------------------------------
# scan: documents and keys of every file, into work files
# --------------------------------------------------------------------------------------------


@dataclass
class SourceScan:
    """A token source after its scan: files, their statistics and the document table (work files:
    ``starts``, ``lengths`` int64 and ``keys`` uint64, one entry per non-empty document)."""

    index: int
    src: SourceConfig
    where: str
    files: list[TokenFile]
    stats: list[ScanStats]
    work: Path
    num_documents: int = 0
    file_documents: list[int] = field(default_factory=list)

    def table(self, name: str) -> np.ndarray:
        dtype = np.uint64 if name == "keys" else np.int64
        if self.num_documents == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.work / f"{name}.bin", dtype=dtype, mode="r", shape=(self.num_documents,))


def check_ids(tf: TokenFile, st: ScanStats, where: str, id_space: int | None = None, tokenizer: str = "") -> None:
    """Refuse a negative id, and (with ``id_space``, the tokenizer's largest id + 1) an id the
    tokenizer does not have. ``where`` names the source (or the command-line option)."""
    if st.min_id < 0:
        raise ConfigError(f"{tf.name!r} ({where}): holds token id {st.min_id}: token ids are never negative, so the "
                          "file is damaged or not token ids: write it again")
    if id_space is not None and st.max_id >= id_space:
        problem = "the file was made with another tokenizer"
        fix = "use the tokenizer the file was made with (data.tokenizer.path)"
        if tf.format == "raw" and tf.dtype == np.uint32 and id_space <= 65_536 <= st.max_id:
            field = f"{where}.token_dtype" if where.startswith("data.") else "--token-dtype"
            problem += (", or it holds uint16 ids read as uint32 (two uint16 ids make one uint32 id of 65,536 or "
                        "more)")
            fix = f"set `{field}` to uint16 if the file was written as uint16, else {fix}"
        elif tf.format == "raw":
            problem += ", or its token dtype is not the one it was written with"
        raise ConfigError(f"{tf.name!r} ({where}): holds token id {st.max_id}, but the tokenizer ({tokenizer}) has ids "
                          f"0..{id_space - 1}: {problem}: {fix}")


def check_token_file_ids(name: str, where: str, max_id: int, model_vocab_size: int, recipe: str | None = None) -> None:
    """Refuse a token file whose largest id ``max_id`` is not below ``model_vocab_size``
    (``model.vocab_size``, of ``recipe`` when given): the model has no embedding row for it.
    ``where`` names the source (``data.sources[i]``) or the command. Raises ConfigError naming the
    file, the id, the field and its value, and the fix."""
    if max_id >= model_vocab_size:
        of = f" in {recipe}" if recipe else ""
        raise ConfigError(f"{name!r} ({where}) holds token id {max_id}, not below `model.vocab_size` "
                          f"({model_vocab_size}{of}): the model has no row for it; set model.vocab_size{of} to at "
                          f"least {max_id + 1} (a multiple of 128 is usual), or drop the file from the source")


def check_eot(tf: TokenFile, st: ScanStats, eot_id: int | None, field_name: str) -> None:
    """Refuse a flat file in which ``eot_id`` never occurs (``field_name``: where it was given)."""
    if tf.format != "megatron" and eot_id is not None and st.ended_by_eot == 0:
        dtype_field = field_name.replace("eot_id", "token_dtype").replace("eot-id", "token-dtype")
        dtype = (f", or `{dtype_field}` ({tf.dtype.name}) is not the dtype the file was written with"
                 if tf.format == "raw" else "")
        raise ConfigError(f"{tf.name!r}: no end-of-text id {eot_id} in its {tf.num_tokens:,} tokens, so it holds no "
                          f"document end: `{field_name}` is not the id the file's documents end with (or the file is "
                          f"one unfinished document){dtype}: give the right id{' and dtype' if dtype else ''}")


def scan_source(src: SourceConfig, index: int, eot_id: int, id_space: int, cfg: DataConfig, work: Path) -> SourceScan:
    """Open and scan every file of a token source, writing its document table under ``work``.

    Raises ConfigError naming the file for a damaged file, an id outside the tokenizer
    (``id_space``: its largest id + 1), a flat file without ``eot_id``, or a source without documents.
    """
    where = f"data.sources[{index}]"
    paths = resolve_token_paths(src, where)
    files = [open_token_path(p, src, where) for p in paths]
    work.mkdir(parents=True, exist_ok=True)
    scan = SourceScan(index, src, where, files, [], work)
    with open(work / "starts.bin", "wb") as fs, open(work / "lengths.bin", "wb") as fl, \
            open(work / "keys.bin", "wb") as fk:
        for tf in files:
            st, tokens, count = ScanStats(), tf.tokens(), 0
            for starts, lengths in documents(tf, eot_id, st):
                fs.write(starts.astype(np.int64).tobytes())
                fl.write(lengths.astype(np.int64).tobytes())
                fk.write(content_keys(tokens, starts, lengths, cfg.seed).tobytes())
                count += len(starts)
            check_ids(tf, st, where, id_space, f"data.tokenizer.path {str(cfg.tokenizer.path)!r}")
            check_eot(tf, st, src.eot_id, f"{where}.eot_id")
            scan.stats.append(st)
            scan.file_documents.append(count)
    scan.num_documents = sum(scan.file_documents)
    if scan.num_documents == 0:
        raise ConfigError(f"`{where}` ({src.label()}): no documents with tokens in {len(files)} file(s) "
                          f"({sum(s.empty_documents for s in scan.stats)} empty): remove the source or fix its files")
    return scan


# --------------------------------------------------------------------------------------------
# write: per-split stream indexes, virtual shards, manifest
# --------------------------------------------------------------------------------------------


def _array_record(root: Path, rel: str) -> dict:
    path = root / rel
    return {"file": rel, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


class _SplitWriter:
    """Appends the documents of one split to its ``starts`` / ``offsets`` / ``file_first`` arrays."""

    def __init__(self, root: Path, name: str, count: int, num_files: int):
        self.root, self.name = root, name
        (root / "streams").mkdir(exist_ok=True)
        self.rel = {k: f"streams/{name}-{k}.npy" for k in ("starts", "offsets", "file_first")}
        self.starts = np.lib.format.open_memmap(root / self.rel["starts"], "w+", np.int64, (count,))
        self.offsets = np.lib.format.open_memmap(root / self.rel["offsets"], "w+", np.int64, (count + 1,))
        self.offsets[0] = 0
        self.file_first = np.zeros(num_files + 1, dtype=np.int64)
        self.n = 0

    def add(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        k = len(starts)
        self.starts[self.n:self.n + k] = starts
        self.offsets[self.n + 1:self.n + k + 1] = self.offsets[self.n] + np.cumsum(lengths + 1)
        self.n += k

    def end_file(self, f: int) -> None:
        self.file_first[f + 1] = self.n

    def close(self) -> dict:
        self.starts.flush()
        self.offsets.flush()
        np.save(self.root / self.rel["file_first"], self.file_first)
        total = int(self.offsets[self.n])
        del self.starts, self.offsets
        return {"documents": self.n, "tokens": total,
                "arrays": {k: _array_record(self.root, rel) for k, rel in self.rel.items()}}


def _route(scan: SourceScan, n_val: int, writers: dict[str, _SplitWriter]) -> None:
    """Send each document to the validation writer (the ``n_val`` smallest keys, ties: the
    earlier document) or the train writer, file by file, in file order."""
    starts, lengths, keys = scan.table("starts"), scan.table("lengths"), scan.table("keys")
    t, ties = select_smallest(keys, n_val) if n_val else (0, 0)
    first = 0
    for f, count in enumerate(scan.file_documents):
        for a in range(first, first + count, _WRITE_DOCS):
            b = min(first + count, a + _WRITE_DOCS)
            k = np.asarray(keys[a:b])
            val = k < np.uint64(t) if n_val else np.zeros(b - a, dtype=bool)
            if ties:
                equal = np.flatnonzero(k == np.uint64(t))[:ties]
                val[equal] = True
                ties -= len(equal)
            s, ln = np.asarray(starts[a:b]), np.asarray(lengths[a:b])
            writers["validation"].add(s[val], ln[val])
            writers["train"].add(s[~val], ln[~val])
        first += count
        for w in writers.values():
            w.end_file(f)


def _virtual_shards(root: Path, name: str, record: dict, split: str, domain: str, index: int, max_id: int,
                    max_tokens: int) -> list[dict]:
    offsets = np.load(root / record["arrays"]["offsets"]["file"], mmap_mode="r")
    shards = []
    for lo in range(0, record["tokens"], max_tokens):
        hi = min(lo + max_tokens, record["tokens"])
        ended = int(np.searchsorted(offsets, hi, "right") - np.searchsorted(offsets, lo, "right"))
        shards.append({"file": None, "stream": name, "offset": lo, "split": split, "domain": domain, "source": index,
                       "tokens": hi - lo, "documents": ended, "max_token_id": max_id})
    return shards


def _file_record(index: int, tf: TokenFile, st: ScanStats, documents: int) -> dict:
    def ident(p: Path) -> dict:
        stat = p.stat()
        return {"path": str(p.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "sample_sha256": sha256_sample(p)}
    return {"source": index, "name": tf.name, "format": tf.format, "dtype": tf.dtype.name, "offset": tf.offset,
            "num_tokens": tf.num_tokens, **ident(tf.path), "index": ident(tf.index) if tf.index else None,
            "documents": documents, "empty_documents": st.empty_documents, "content_tokens": st.content_tokens,
            "ended_by_eot": st.ended_by_eot, "min_token_id": st.min_id, "max_token_id": st.max_id}


def write_source(root: Path, scan: SourceScan, n_val: int, domain: str, first_file: int, max_tokens: int,
                 ) -> tuple[dict, list[dict], dict, list[dict]]:
    """Split a scanned source and write its stream indexes under ``root``.

    ``first_file``: the manifest position of this source's first file. Returns the source's
    ``meta.json`` record, its virtual shards, its streams ``{name: record}`` and its file records.
    """
    n = scan.num_documents
    writers = {split: _SplitWriter(root, f"{split}-s{scan.index:02d}", count, len(scan.files))
               for split, count in (("train", n - n_val), ("validation", n_val))}
    _route(scan, n_val, writers)
    max_id = max(st.max_id for st in scan.stats)
    file_ids = list(range(first_file, first_file + len(scan.files)))
    streams, shards = {}, []
    for split, w in writers.items():
        record = {"split": split, "source": scan.index, "files": file_ids, **w.close()}
        streams[w.name] = record
        shards += _virtual_shards(root, w.name, record, split, domain, scan.index, max_id, max_tokens)
    files = [_file_record(scan.index, tf, st, c)
             for tf, st, c in zip(scan.files, scan.stats, scan.file_documents, strict=True)]
    src = scan.src
    source = {"index": scan.index, "label": src.label(), "domain": domain, "weight": src.weight, "kind": src.kind(),
              "files": len(scan.files), "documents": n,
              "skipped": {"empty_document": sum(st.empty_documents for st in scan.stats)}, "replaced_invalid_utf8": 0,
              "train_documents": n - n_val, "validation_documents": n_val,
              "train_tokens": streams[f"train-s{scan.index:02d}"]["tokens"],
              "validation_tokens": streams[f"validation-s{scan.index:02d}"]["tokens"], "max_token_id": max_id}
    return source, shards, streams, files


# --------------------------------------------------------------------------------------------
# reading: packed streams
# --------------------------------------------------------------------------------------------


class PackedStream:
    """The packed stream of one (split, source): document contents from the user's files, each
    followed by one end-of-text id. Files are opened lazily as read-only memory maps (at most
    64 at a time). Positions and lengths in tokens."""

    def __init__(self, root: Path, record: dict, files: list[dict], eot_id: int):
        arrays = record["arrays"]
        self.starts = np.load(root / arrays["starts"]["file"], mmap_mode="r")
        self.offsets = np.load(root / arrays["offsets"]["file"], mmap_mode="r")
        self.file_first = np.load(root / arrays["file_first"]["file"])
        self.files = [files[i] for i in record["files"]]
        self.eot_id, self.num_tokens = eot_id, int(record["tokens"])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def _file(self, f: int) -> np.ndarray:
        if f in self._maps:
            self._maps.move_to_end(f)
            return self._maps[f]
        rec = self.files[f]
        arr = np.asarray(np.memmap(rec["path"], dtype=np.dtype(rec["dtype"]), mode="r", offset=rec["offset"],
                                   shape=(rec["num_tokens"],)))
        self._maps[f] = arr
        if len(self._maps) > _OPEN_FILES:
            self._maps.popitem(last=False)
        return arr

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens ``[a, b)`` of the stream, (b - a,) uint32 (``0 <= a <= b <= num_tokens``)."""
        out = np.empty(max(0, b - a), dtype=np.uint32)
        if b <= a:
            return out
        j = int(np.searchsorted(self.offsets, a, "right")) - 1
        pos = a
        while pos < b:
            o, end = int(self.offsets[j]), int(self.offsets[j + 1])  # document j: content [o, end - 1), eot at end - 1
            f = int(np.searchsorted(self.file_first, j, "right")) - 1
            lo, hi = pos - o, min(b, end - 1) - o
            if hi > lo:
                s = int(self.starts[j])
                out[pos - a:pos - a + hi - lo] = self._file(f)[s + lo:s + hi]
            if b >= end:
                out[end - 1 - a] = self.eot_id
            pos, j = end, j + 1
        return out


class PackedTokens:
    """A read-only 1-D view of ``length`` tokens of a :class:`PackedStream` from ``offset``: what
    ``PreparedData.tokens`` gives for a virtual shard. Slicing (step 1) and ``np.asarray`` read
    the range and return a uint32 array; ``len``, ``shape`` and ``dtype`` read nothing."""

    def __init__(self, stream: PackedStream, offset: int, length: int):
        self.stream, self.offset, self.length = stream, offset, length
        self.dtype = np.dtype(np.uint32)

    def __len__(self) -> int:
        return self.length

    @property
    def shape(self) -> tuple[int]:
        return (self.length,)

    def __getitem__(self, key: slice | int) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                raise IndexError("PackedTokens supports slices with step 1 only")
            return self.stream.read(self.offset + start, self.offset + max(start, stop))
        i = int(key) + (self.length if int(key) < 0 else 0)
        if not 0 <= i < self.length:
            raise IndexError(f"index {key} is out of range for {self.length} tokens")
        return self.stream.read(self.offset + i, self.offset + i + 1)[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------
# verification when opened
# --------------------------------------------------------------------------------------------


class TokenFileChanged(ConfigError):
    """A user file (``path``) of a token source no longer matches the manifest of a prepared
    directory (missing, another size, another sampled sha256). ``smelt-ds data prepare`` catches
    it to prepare the directory again (:func:`smelt_ds.data.prepare.prepare_from_config`)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


def relocate_token_files(meta: dict, sources: list[SourceConfig]) -> int:
    """Point each user file of ``meta`` (``token_files``) at where ``sources`` (the recipe's
    ``data.sources``) find it now, in place; returns how many records moved.

    The preparation key does not depend on where the files are (the same volume is mounted at one
    path on a login node and at another in a Kubernetes pod), so a preparation is reused from
    another path; the data are read in place, so they must then be read where they are now. The
    k-th file of source i is the k-th of :func:`resolve_token_paths` (both in sorted order), with
    the same file name. A source whose files cannot be resolved, or differ in number or names,
    keeps its recorded paths, and verification (:func:`verify_token_files`) names what is missing."""
    moved = 0
    for i, src in enumerate(sources):
        recs = [r for r in meta.get("token_files", []) if r["source"] == i]
        if not recs or not src.is_token_source():
            continue
        try:
            paths = resolve_token_paths(src, f"data.sources[{i}]")
            pairs = [megatron_pair(p)[::-1] if src.kind() == "megatron" else (p, None) for p in paths]
        except ConfigError:
            continue
        if len(pairs) != len(recs) or any(Path(r["path"]).name != data.name
                                          for r, (data, _) in zip(recs, pairs, strict=True)):
            continue
        for rec, (data, index) in zip(recs, pairs, strict=True):
            if rec["path"] != str(data.resolve()):
                moved += 1
            rec["path"] = str(data.resolve())
            rec["name"] = str(data.with_suffix("")) if index is not None else str(data)
            if index is not None and rec.get("index"):
                rec["index"]["path"] = str(index.resolve())
    return moved


def _verify_file(root: Path, ident: dict, name: str, level: str) -> None:
    path = Path(ident["path"])
    redo = ("the prepared data read this file in place: restore it, or prepare again (a change of size gives a new "
            "preparation key, so `smelt-ds data prepare` and training do that)")
    if not path.is_file():
        raise TokenFileChanged(f"{str(path)!r} (of {name}) is missing: {redo}", path)
    size = path.stat().st_size
    if size != ident["size"]:
        raise TokenFileChanged(f"{str(path)!r} (of {name}) has {size:,} bytes, {ident['size']:,} when it was prepared: "
                               f"it was truncated or rewritten: {redo}", path)
    if level == "checksum" and sha256_sample(path) != ident["sample_sha256"]:
        raise TokenFileChanged(
            f"{str(path)!r} (of {name}): its sampled sha256 differs from when it was prepared: it was modified (its "
            f"size and modification time are unchanged, so its preparation key is too, and {str(root)!r} is reused): "
            f"the prepared data read this file in place: restore it, or run `smelt-ds data prepare --recipe RECIPE` "
            "with the recipe that prepared it, which sees the change and prepares that directory again", path)


def verify_token_files(root: Path, meta: dict, level: str) -> None:
    """Check the user files of token sources (``size``: sizes; ``checksum``: also the sha256 of
    a 1 MiB sample of each) and the stream index arrays (size; ``checksum``: sha256).
    Raises :class:`TokenFileChanged` for a user file, ConfigError for a stream index, naming the
    file and the fix."""
    for rec in meta.get("token_files", []):
        _verify_file(root, rec, rec["name"], level)
        if rec["index"] is not None:
            _verify_file(root, rec["index"], rec["name"], level)
    for stream in meta.get("streams", {}).values():
        for arr in stream["arrays"].values():
            path = root / arr["file"]
            ok = path.is_file() and path.stat().st_size == arr["bytes"]
            if ok and level == "checksum":
                ok = sha256_file(path) == arr["sha256"]
            if not ok:
                raise ConfigError(f"stream index {str(path)!r} is missing, truncated or modified (meta.json: "
                                  f"{arr['bytes']} bytes, sha256 {arr['sha256'][:12]}): the prepared directory is "
                                  "damaged; delete it and prepare again")


# --------------------------------------------------------------------------------------------
# inspection (smelt-ds data inspect)
# --------------------------------------------------------------------------------------------


def open_any(path: str | Path, token_dtype: str | None = None) -> TokenFile:
    """Open a Megatron pair (``PREFIX``, ``PREFIX.idx``, or ``PREFIX.bin`` beside its .idx) or a
    flat token file, deciding by the files present. Raises ConfigError for a missing path or a
    directory, or as :func:`open_megatron` / :func:`open_flat` do."""
    p = Path(path).expanduser()
    prefix = megatron_prefix(p)
    if p.is_dir():
        raise ConfigError(f"{str(p)!r} is a directory: give its files (e.g. {p}/*.npy or {p}/*.idx)")
    pair = prefix.with_name(prefix.name + ".idx").is_file()
    if p.suffix == ".idx" or (pair and (p.suffix == ".bin" or not p.exists())):
        return open_megatron(prefix)
    if not p.is_file():
        raise ConfigError(f"{str(p)!r}: no such file, and no Megatron pair {str(p)!r}.idx/.bin: fix the path")
    return open_flat(p, token_dtype, "--token-dtype")


def inspect_file(tf: TokenFile, eot_id: int | None) -> ScanStats:
    """Scan ``tf`` (every token once, nothing kept) and return its statistics. Raises ConfigError
    for a negative id, or for a flat file in which ``eot_id`` (when given) never occurs."""
    st = ScanStats()
    for _ in documents(tf, eot_id, st):
        pass
    check_ids(tf, st, "inspect")
    check_eot(tf, st, eot_id, "--eot-id")
    return st


# --------------------------------------------------------------------------------------------
# before the queue (smelt-ds preflight, render-job)
# --------------------------------------------------------------------------------------------


class TokenFilesNotFound(ConfigError):
    """A token source none of whose files is on this machine (:func:`resolve_token_paths` found
    none): ``where`` names the source (``data.sources[i]``)."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


def check_source_ids(data: DataConfig, model_vocab_size: int, max_tokens: int = PREFLIGHT_SCAN_TOKENS) -> str:
    """The largest token id of every file of the token sources of ``data`` (``megatron``,
    ``tokens``) against the tokenizer of ``data.tokenizer.path`` and ``model_vocab_size``, before
    anything is prepared (``smelt-ds preflight``, ``render-job``).

    Each file is opened as preparing and ``smelt-ds data inspect`` open it (header, index and
    sizes checked; a raw uint16 file that holds uint32 ids refused) and its ids are read as they
    read them (:func:`~smelt_ds.data.token_files.scan_ids`, bounded memory): every token when the
    files hold at most ``max_tokens`` tokens in all, else at most ``max_tokens / files`` tokens of
    each, in evenly spread windows (the first and the last included; a smaller file is read
    whole), so an id outside the sample is found only when the data are prepared. The ids are
    checked with :func:`check_ids` (against the tokenizer's ids, when ``data.tokenizer.path``
    loads here) and :func:`check_token_file_ids` (against ``model_vocab_size``). Returns a summary
    line (files, largest id, what was read). Raises :class:`TokenFilesNotFound` for a source
    without files here (relative paths are read in the current directory), ConfigError naming the
    file, its largest id, the tokenizer's ids or ``model.vocab_size`` and the fix.
    """
    sources = [(i, src) for i, src in enumerate(data.sources) if src.is_token_source()]
    if not sources:
        return "no megatron or tokens source (token ids are checked when text is tokenised)"
    files: list[tuple[str, TokenFile]] = []
    for i, src in sources:
        where = f"data.sources[{i}]"
        try:
            paths = resolve_token_paths(src, where)
        except ConfigError as e:
            raise TokenFilesNotFound(str(e), where) from None
        files += [(where, open_token_path(p, src, where)) for p in paths]
    try:
        tok = load_tokenizer(data.tokenizer.path, "data.tokenizer.path") if data.tokenizer.path else None
    except ConfigError:  # the tokenizer check names the problem
        tok = None
    id_space = tokenizer_id_space(tok) if tok is not None else None
    label = f"data.tokenizer.path {str(data.tokenizer.path)!r}"
    total = sum(tf.num_tokens for _, tf in files)
    share = None if total <= max_tokens else max(1, max_tokens // len(files))
    read, top, top_name, sampled = 0, -1, "", 0
    for where, tf in files:
        st = ScanStats()
        read += scan_ids(tf, st, share)
        sampled += share is not None and tf.num_tokens > share
        check_ids(tf, st, where, id_space, label)
        check_token_file_ids(tf.name, where, st.max_id, model_vocab_size)
        if st.max_id > top:
            top, top_name = st.max_id, tf.name
    fits = (f"the tokenizer's ids 0..{id_space - 1} and model.vocab_size {model_vocab_size}" if id_space is not None
            else f"model.vocab_size {model_vocab_size} ({label} is not read here: see the tokenizer check)")
    how = ("every token read" if not sampled else
           f"{read:,} of {total:,} tokens read: {sampled} file(s) in {ID_SAMPLE_WINDOWS} windows each (preparing "
           "reads every id)")
    return f"{len(files)} token file(s): largest id {top:,} ({top_name}) fits {fits}; {how}"

