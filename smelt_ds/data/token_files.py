"""Files of token ids made elsewhere: Megatron-LM indexed datasets and flat token files.

Both are read in place through memory maps, never whole and never copied.

**Megatron-LM indexed dataset** (``megatron.core.datasets.indexed_dataset``, MMIDIDX): ``PREFIX.bin``
holds the token ids of every sequence back to back; ``PREFIX.idx`` is the header ``MMIDIDX\\0\\0``
(9 bytes), version ``<Q`` = 1, dtype code ``<B`` (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
6 float64, 7 float32, 8 uint16), sequence count S ``<Q``, document count D ``<Q`` (entries of
``document_indices``: documents + 1), then ``sequence_lengths`` int32 (S,), ``sequence_pointers``
int64 (S,) (byte offsets into the .bin), ``document_indices`` int64 (D,) (document d = sequences
``[di[d], di[d+1])``) and, for multimodal data, ``sequence_modes`` int8 (S,). The writer
(``IndexedDatasetBuilder``) stores sequences contiguously, so a document is one token range of the
.bin; that is checked (:func:`open_megatron`), as are the header, the index size, the document
indices and the .bin size (a .bin of another size means a truncated file or another dtype).

**Flat token files** (OLMo-core's numpy token files): one 1-D array of token ids, documents back to
back, each ended by the end-of-text id. A raw file (what ``np.memmap`` / ``ndarray.tofile`` write,
whatever its extension: OLMo's ``.npy`` files are raw) has no header, so its dtype (uint16 or
uint32) comes from the recipe; a file written by ``np.save`` (it starts with ``\\x93NUMPY``)
carries its dtype and shape in its header, read with ``numpy.lib.format``.

**Documents.** A document's *content* is its tokens without a trailing end-of-text id: a flat
file's document is the tokens up to an end-of-text id (the tokens after the last one, if any, are a
last document without it); a Megatron document is its token range, minus its last token when that
is the end-of-text id (``preprocess_data.py --append-eod``). Documents with no content are empty:
counted, never used. Shapes are in tokens; ``starts`` are token offsets into the file's token array.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from smelt_ds.errors import ConfigError

__all__ = ["MEGATRON_MAGIC", "MEGATRON_DTYPES", "NPY_MAGIC", "TokenFile", "ScanStats", "open_megatron",
           "open_flat", "megatron_prefix", "megatron_pair", "documents", "scan_ids", "window_starts", "content_keys",
           "select_smallest", "CHUNK_TOKENS", "KEY_HEAD_TOKENS", "KEY_TAIL_TOKENS", "ID_SAMPLE_WINDOWS"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
#: Megatron-LM's ``DType`` codes (megatron/core/datasets/indexed_dataset.py)
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
                   8: "uint16"}
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
NPY_MAGIC = b"\x93NUMPY"
FLAT_DTYPES = ("uint16", "uint32")
CHUNK_TOKENS = 1 << 24  # tokens read at once by the scans (64 MiB of uint32)
_CHUNK_DOCUMENTS = 1 << 18  # documents handled at once (index entries)
_CHUNK_KEYS = 1 << 15  # documents hashed at once (arrays of 64 slots each: 16 MiB)
#: the document key hashes the content's first KEY_HEAD_TOKENS and last KEY_TAIL_TOKENS tokens and its length
KEY_HEAD_TOKENS, KEY_TAIL_TOKENS = 48, 16
#: the uint32-read-as-uint16 check of raw files: windows of bytes read, and the pairs needed to decide
DTYPE_SAMPLE_WINDOWS, DTYPE_SAMPLE_BYTES, DTYPE_MIN_PAIRS = 4, 1 << 20, 32
#: windows of a file that :func:`scan_ids` reads when it may not read the whole file
ID_SAMPLE_WINDOWS = 8


@dataclass
class TokenFile:
    """One file of token ids, its header and sizes checked (see :func:`open_megatron`, :func:`open_flat`).

    ``path``: the token data (the .bin of a Megatron pair); ``index``: the .idx, or None;
    ``format``: ``megatron``, ``npy`` or ``raw``; ``offset``: bytes before the first token;
    ``num_tokens``: tokens in the file; ``num_documents``: Megatron documents (None: found by a scan).
    """

    path: Path
    format: str
    dtype: np.dtype
    offset: int
    num_tokens: int
    index: Path | None = None
    num_documents: int | None = None
    _doc_bounds: np.ndarray | None = None  # megatron: token offset of each document's start, (D,) int64

    @property
    def name(self) -> str:
        """The file as users name it: the prefix of a Megatron pair, else the path."""
        return str(self.path.with_suffix("")) if self.format == "megatron" else str(self.path)

    def tokens(self) -> np.ndarray:
        """The token ids, shape (num_tokens,), a read-only memory map (nothing is read yet)."""
        if self.num_tokens == 0:
            return np.empty(0, dtype=self.dtype)
        return np.asarray(np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                                    shape=(self.num_tokens,)))

    def document_bounds(self, d0: int, d1: int) -> np.ndarray:
        """Megatron: token offsets where documents ``d0 .. d1`` start, (d1 - d0 + 1,) int64; entry
        ``d1`` is where document ``d1 - 1`` ends."""
        assert self._doc_bounds is not None
        return np.asarray(self._doc_bounds[d0:d1 + 1])


def _fail(path: Path | str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{str(path)!r}: {problem}: {fix}")


def _nonempty(path: Path, what: str) -> int:
    if not path.is_file():
        raise _fail(path, f"no such {what}", "fix the path, or write the file first")
    size = path.stat().st_size
    if size == 0:
        raise _fail(path, f"the {what} is empty (0 bytes)", "write it again, or remove it from the source")
    return size


# --------------------------------------------------------------------------------------------
# Megatron-LM .bin / .idx
# --------------------------------------------------------------------------------------------


def megatron_prefix(path: str | Path) -> Path:
    """``PREFIX`` for ``PREFIX``, ``PREFIX.idx`` or ``PREFIX.bin``."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".idx", ".bin") else p


def megatron_pair(path: str | Path) -> tuple[Path, Path]:
    """``(PREFIX.idx, PREFIX.bin)`` for a prefix or either file; ConfigError when the .bin is missing."""
    prefix = megatron_prefix(path)
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    if idx.is_file() and not bin_.is_file():
        raise _fail(bin_, "no such Megatron data file (.bin) beside its .idx", "copy the .bin with its .idx")
    return idx, bin_


def _read_header(idx: Path, size: int) -> tuple[np.dtype, int, int]:
    """dtype, sequence count and document-index count of an .idx, checked."""
    fix_rewrite = "write the dataset again with megatron-core's IndexedDatasetBuilder (preprocess_data.py)"
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
    if not (head[:9] == MEGATRON_MAGIC or MEGATRON_MAGIC.startswith(head)):
        raise _fail(idx, f"not a Megatron-LM index: it starts with {head[:9]!r}, not {MEGATRON_MAGIC!r}",
                    "give the .idx written with its .bin (or a flat token file as a `tokens` source)")
    if len(head) < _IDX_HEADER_BYTES:
        raise _fail(idx, f"the index is truncated: {size} bytes, shorter than its {_IDX_HEADER_BYTES}-byte header",
                    fix_rewrite)
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise _fail(idx, f"index version {version}, not 1 (the only MMIDIDX version Megatron-LM writes and reads)",
                    fix_rewrite)
    name = MEGATRON_DTYPES.get(code)
    if name is None:
        raise _fail(idx, f"dtype code {code} is not a Megatron-LM DType code ({MEGATRON_DTYPES})", fix_rewrite)
    if not np.issubdtype(np.dtype(name), np.integer):
        raise _fail(idx, f"dtype {name} (code {code}): the .bin holds floats, not token ids",
                    "give a tokenised dataset (uint16 or int32 token ids)")
    expected = _IDX_HEADER_BYTES + 12 * seqs + 8 * docs
    if size not in (expected, expected + seqs):  # + int8 sequence modes of multimodal data
        raise _fail(idx, f"the index has {size:,} bytes, but its header ({seqs:,} sequences, {docs:,} document "
                         f"indices) needs {expected:,}: the index is truncated or damaged", fix_rewrite)
    if docs < 1:
        raise _fail(idx, "the index has no document indices (not even the leading 0)", fix_rewrite)
    return np.dtype(name), int(seqs), int(docs)


def _check_sequences(idx: Path, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Total tokens; checks that sequences are stored back to back from byte 0 (as the writer does)."""
    total = 0
    for a in range(0, len(lengths), _CHUNK_DOCUMENTS):
        ln = np.asarray(lengths[a:a + _CHUNK_DOCUMENTS], dtype=np.int64)
        ptr = np.asarray(pointers[a:a + _CHUNK_DOCUMENTS])
        expected = (total + np.concatenate([[0], np.cumsum(ln)[:-1]])) * itemsize
        if (ln < 0).any() or not np.array_equal(ptr, expected):
            bad = a + int(np.flatnonzero((ln < 0) | (ptr != expected))[0])
            raise _fail(idx, f"sequence {bad}: pointer {int(pointers[bad])} / length {int(lengths[bad])} do not follow "
                             "the sequences before it (the writer stores them back to back): the index is damaged",
                        "write the dataset again with megatron-core's IndexedDatasetBuilder")
        total += int(ln.sum())
    return total


def _doc_bounds(idx: Path, doc_index: np.ndarray, lengths: np.ndarray, pointers: np.ndarray, itemsize: int,
                total: int) -> np.ndarray:
    """Token offset where each document starts (D,) int64 (entry D-1 = total), document indices checked."""
    seqs = len(lengths)
    di = np.asarray(doc_index)
    if di[0] != 0 or di[-1] != seqs or (np.diff(di) < 0).any():
        raise _fail(idx, f"document indices must rise from 0 to the sequence count {seqs} (they go from {int(di[0])} "
                         f"to {int(di[-1])}{', not rising' if (np.diff(di) < 0).any() else ''}): the index is damaged",
                    "write the dataset again with megatron-core's IndexedDatasetBuilder")
    seq_start = np.empty(seqs + 1, dtype=np.int64)  # token offset of each sequence, + the end
    seq_start[:seqs] = np.asarray(pointers) // itemsize
    seq_start[seqs] = total
    return seq_start[di]


def open_megatron(path: str | Path) -> TokenFile:
    """Open a Megatron-LM ``PREFIX.bin`` / ``PREFIX.idx`` pair (``path``: the prefix or either file).

    Checks the header (magic, version 1, an integer dtype code), that the index's size matches its
    counts, that sequences lie back to back, that document indices rise from 0 to the sequence
    count, and that the .bin holds exactly the tokens the index describes. Raises ConfigError
    naming the file, the problem and the fix (for a .bin of another size, the dtype that would fit).
    """
    idx, bin_ = megatron_pair(path)
    dtype, seqs, docs = _read_header(idx, _nonempty(idx, "Megatron index (.idx)"))
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    lengths = raw[_IDX_HEADER_BYTES:_IDX_HEADER_BYTES + 4 * seqs].view(np.int32)
    pointers = raw[_IDX_HEADER_BYTES + 4 * seqs:_IDX_HEADER_BYTES + 12 * seqs].view(np.int64)
    doc_index = raw[_IDX_HEADER_BYTES + 12 * seqs:_IDX_HEADER_BYTES + 12 * seqs + 8 * docs].view(np.int64)
    total = _check_sequences(idx, lengths, pointers, dtype.itemsize)
    bounds = _doc_bounds(idx, doc_index, lengths, pointers, dtype.itemsize, total)
    size, want = bin_.stat().st_size, total * dtype.itemsize
    if size != want:
        other = [n for n in sorted(set(MEGATRON_DTYPES.values()) - {dtype.name})
                 if np.issubdtype(np.dtype(n), np.integer) and total * np.dtype(n).itemsize == size]
        problem = ("the .bin is empty (0 bytes)" if size == 0 else
                   f"the .bin has {size:,} bytes, the index describes {total:,} tokens of {dtype.name} "
                   f"= {want:,} bytes")
        hint = (f" (the size fits {', '.join(other)}: the index and the .bin were written with different dtypes)"
                if other else " (truncated)" if size < want else "")
        raise _fail(bin_, problem + hint, "use the .idx written together with this .bin, or write both again")
    if total == 0:
        raise _fail(bin_, f"the dataset holds no tokens ({docs - 1} documents, all empty)",
                    "remove it from the source")
    return TokenFile(bin_, "megatron", dtype, 0, total, idx, docs - 1, bounds)


# --------------------------------------------------------------------------------------------
# flat token files
# --------------------------------------------------------------------------------------------


def _npy_header(path: Path) -> tuple[np.dtype, tuple, int]:
    """dtype, shape and header length of a file written by ``np.save``."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            if version not in read:
                raise ValueError(f"format version {version}, not 1.0 or 2.0")
            shape, _, dtype = read[version](f)
        except Exception as e:  # numpy raises ValueError, SyntaxError, tokenize errors, ... for a bad header
            raise _fail(path, f"the .npy header cannot be read ({type(e).__name__}: {e})",
                        "write the file again with np.save") from None
        return np.dtype(dtype), tuple(shape), f.tell()


def open_flat(path: str | Path, token_dtype: str | None, dtype_field: str = "token_dtype") -> TokenFile:
    """Open a flat token file: an ``np.save`` file (its header gives dtype and shape) or a raw one
    (``token_dtype`` gives the dtype). Raises ConfigError naming the file for an empty file, a raw
    file without ``token_dtype`` or whose size is not a whole number of tokens, an ``np.save`` file
    whose dtype is not uint16/uint32 or differs from ``token_dtype``, that is not 1-D, or that is
    shorter than its header says. ``dtype_field`` names where ``token_dtype`` comes from."""
    p = Path(path)
    size = _nonempty(p, "token file")
    with open(p, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic == NPY_MAGIC:
        dtype, shape, offset = _npy_header(p)
        if dtype.name not in FLAT_DTYPES or not dtype.isnative:
            raise _fail(p, f"np.save file of dtype {dtype.str}, not uint16 or uint32",
                        "save the ids as np.uint16 (vocabularies up to 65,536) or np.uint32: "
                        "np.save(path, ids.astype(np.uint32))")
        if token_dtype is not None and token_dtype != dtype.name:
            raise _fail(p, f"the file's header says {dtype.name}, `{dtype_field}` says {token_dtype}",
                        f"set {dtype_field} to {dtype.name} (or leave it unset for np.save files)")
        if len(shape) != 1:
            raise _fail(p, f"np.save file of shape {shape}, not 1-D", "save one flat array of token ids")
        if size - offset != shape[0] * dtype.itemsize:
            raise _fail(p, f"the header says {shape[0]:,} tokens ({shape[0] * dtype.itemsize:,} bytes), the file holds "
                           f"{size - offset:,} bytes after it: truncated or damaged", "write the file again")
        return TokenFile(p, "npy", dtype, offset, int(shape[0]))
    if token_dtype is None:
        raise _fail(p, "a raw token file (no np.save header) does not record its dtype",
                    f"set `{dtype_field}` to uint16 or uint32 (what the file was written with)")
    dtype = np.dtype(token_dtype)
    if size % dtype.itemsize:
        raise _fail(p, f"{size:,} bytes is not a whole number of {dtype.name} tokens: truncated, or another dtype",
                    f"check `{dtype_field}`, or write the file again")
    if dtype == np.uint16:
        _refuse_uint32_as_uint16(p, size, dtype_field)
    return TokenFile(p, "raw", dtype, 0, size // dtype.itemsize)


def _uint16_pairs_sample(path: Path, size: int) -> np.ndarray:
    """Up to :data:`DTYPE_SAMPLE_WINDOWS` windows of :data:`DTYPE_SAMPLE_BYTES` of a raw file
    (the first and the last included, evenly spaced), as (n, 2) uint16 pairs: column 0 holds the
    ids at even positions of the file, column 1 those at odd positions (windows start on 4-byte
    boundaries, so a pair is the two halves of one uint32)."""
    pairs = np.memmap(path, dtype=np.uint16, mode="r", shape=(size // 4, 2))
    per = DTYPE_SAMPLE_BYTES // 4
    return np.concatenate([np.asarray(pairs[a:a + per]) for a in window_starts(len(pairs), per, DTYPE_SAMPLE_WINDOWS)])


def window_starts(n: int, per: int, count: int) -> list[int]:
    """Starts of ``count`` windows of ``per`` items spread evenly over ``n`` items, the first
    window at 0 and the last ending at ``n`` (fewer when they coincide; one at 0 when
    ``per >= n``). ``count >= 2``."""
    return sorted({k * max(0, n - per) // (count - 1) for k in range(count)})


def _refuse_uint32_as_uint16(path: Path, size: int, dtype_field: str) -> None:
    """Refuse a raw file declared uint16 whose sample shows uint32 ids read as two uint16 each.

    A little-endian uint32 id ``v`` reads as the uint16 ``v & 0xFFFF`` then ``v >> 16``: with ids
    below 65,536 every uint16 at an odd position is 0; with ids below 262,144 (every vocabulary in
    use: Gemma 3 has 262,144 tokens) every one is at most 3 while the low halves spread over
    0..65,535. Big-endian uint32 ids give the same at even positions once each uint16's bytes are
    swapped. Refused when the sample (:func:`_uint16_pairs_sample`) holds at least
    :data:`DTYPE_MIN_PAIRS` pairs and the high halves are all 0 while the low halves are not, or
    all at most 3 while the low halves reach 4,096.

    False positives: a real uint16 file is refused only if every second token of the sample is id 0
    (first rule), or one of ids 0..3 while the others reach id 4,096 (second rule): a file of
    one-token documents, never text. A small vocabulary (DNA letters as ids 0..3) meets neither
    rule: its ids never reach 4,096, and it is not id 0 at every second position. An odd number
    of uint16, or fewer than 32 pairs, is never refused.

    Raises ConfigError naming the file, what was seen and ``dtype_field`` (set to uint32)."""
    if size % 4 or size < 4 * DTYPE_MIN_PAIRS:  # an odd number of uint16 cannot be uint32 ids; too few to tell
        return
    pairs = _uint16_pairs_sample(path, size)
    little, big = pairs.max(axis=0), pairs.byteswap().max(axis=0)  # (2,): largest at even / odd positions
    for hi, lo, parity, order in ((int(little[1]), int(little[0]), "odd", "little"),
                                  (int(big[0]), int(big[1]), "even", "big")):
        if not ((hi == 0 < lo) or (hi <= 3 and lo >= 4096)):
            continue
        swapped = " once its bytes are swapped" if order == "big" and hi else ""
        seen = "0" if hi == 0 else f"at most {hi}{swapped}, while the others reach {lo:,}"
        fix = (f"set `{dtype_field}` to uint32" if order == "little" else
               f"write the ids again as little-endian uint32 (ids.astype('<u4').tofile(path)) and set `{dtype_field}` "
               "to uint32")
        where = ("the whole file" if size <= DTYPE_SAMPLE_WINDOWS * DTYPE_SAMPLE_BYTES else
                 f"{DTYPE_SAMPLE_WINDOWS * DTYPE_SAMPLE_BYTES >> 20} MiB spread over it")
        raise _fail(path, f"read as uint16 (`{dtype_field}`), every second uint16 is {seen} (those at {parity} "
                          f"positions, in {where}): the file holds {order}-endian uint32 token ids below "
                          f"{(hi + 1) * 65_536:,}, each read as two uint16", fix)


# --------------------------------------------------------------------------------------------
# scans: documents, id range, document keys
# --------------------------------------------------------------------------------------------


@dataclass
class ScanStats:
    """What a scan of one file found: ids (over every token of the file), documents, content tokens."""

    min_id: int = 0
    max_id: int = -1
    documents: int = 0
    empty_documents: int = 0
    content_tokens: int = 0
    ended_by_eot: int = 0

    def add_ids(self, chunk: np.ndarray, first: bool) -> None:
        if chunk.size:
            lo, hi = int(chunk.min()), int(chunk.max())
            self.min_id = lo if first else min(self.min_id, lo)
            self.max_id = max(self.max_id, hi)

    def add_documents(self, lengths: np.ndarray) -> np.ndarray:
        """Count documents of content ``lengths``; returns the mask of the non-empty ones."""
        keep = lengths > 0
        self.documents += int(keep.sum())
        self.empty_documents += int((~keep).sum())
        self.content_tokens += int(lengths.sum())
        return keep


def scan_ids(tf: TokenFile, stats: ScanStats, max_tokens: int | None = None) -> int:
    """Fill the id range of ``stats`` from the tokens of ``tf``, read :data:`CHUNK_TOKENS` at a time
    (bounded memory): every token when ``max_tokens`` is None or at least ``tf.num_tokens``, else
    :data:`ID_SAMPLE_WINDOWS` windows of ``max_tokens // ID_SAMPLE_WINDOWS`` tokens (at least 1)
    spread evenly over the file, the first and the last included (:func:`window_starts`).
    Returns the number of tokens read. The ids of a Megatron file are its .bin's, whatever its
    documents."""
    tokens, n = tf.tokens(), tf.num_tokens
    if max_tokens is None or n <= max_tokens:
        ranges = [(0, n)]
    else:
        per = max(1, max_tokens // ID_SAMPLE_WINDOWS)
        ranges = [(a, a + per) for a in window_starts(n, per, ID_SAMPLE_WINDOWS)]
    for a, b in ranges:
        for base in range(a, b, CHUNK_TOKENS):
            stats.add_ids(tokens[base:min(b, base + CHUNK_TOKENS)], base == ranges[0][0])
    return sum(b - a for a, b in ranges)


def _flat_documents(tf: TokenFile, eot_id: int | None, stats: ScanStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    if eot_id is None:  # documents unknown: only the id range
        scan_ids(tf, stats)
        return
    tokens, start = tf.tokens(), 0
    for base in range(0, tf.num_tokens, CHUNK_TOKENS):
        chunk = tokens[base:base + CHUNK_TOKENS]
        stats.add_ids(chunk, base == 0)
        ends = np.flatnonzero(chunk == eot_id).astype(np.int64) + base  # positions of end-of-text ids
        if ends.size:
            starts = np.concatenate([[start], ends[:-1] + 1])
            stats.ended_by_eot += int(ends.size)
            lengths = ends - starts
            keep = stats.add_documents(lengths)
            start = int(ends[-1]) + 1
            yield starts[keep], lengths[keep]
    if start < tf.num_tokens:  # the tokens after the last end-of-text
        tail = np.array([tf.num_tokens - start], dtype=np.int64)
        stats.add_documents(tail)
        yield np.array([start], dtype=np.int64), tail


def _megatron_documents(tf: TokenFile, eot_id: int | None, stats: ScanStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    tokens = tf.tokens()
    scan_ids(tf, stats)
    for d0 in range(0, tf.num_documents or 0, _CHUNK_DOCUMENTS):
        bounds = tf.document_bounds(d0, min(d0 + _CHUNK_DOCUMENTS, tf.num_documents or 0))
        starts, lengths = bounds[:-1], np.diff(bounds)
        if eot_id is not None:
            nonempty = lengths > 0
            ended = np.zeros(len(lengths), dtype=bool)
            ended[nonempty] = tokens[starts[nonempty] + lengths[nonempty] - 1] == eot_id
            stats.ended_by_eot += int(ended.sum())
            lengths = lengths - ended
        keep = stats.add_documents(lengths)
        yield starts[keep], lengths[keep]


def documents(tf: TokenFile, eot_id: int | None, stats: ScanStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The non-empty documents of ``tf`` in file order, in chunks: ``(starts, lengths)`` int64,
    the token offset and the content length (tokens, trailing end-of-text excluded) of each.

    Reads every token once (bounded memory: :data:`CHUNK_TOKENS` at a time) and fills ``stats``
    (id range over all tokens, documents, empty documents, content tokens). A flat file without
    ``eot_id`` yields nothing (its documents are unknown) but still fills the id range.
    """
    yield from (_megatron_documents if tf.format == "megatron" else _flat_documents)(tf, eot_id, stats)


def _splitmix64_finish(z: np.ndarray) -> np.ndarray:
    """The output function of SplitMix64 (Steele, Lea, Flood 2014; constants of Vigna's
    splitmix64.c), elementwise on uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key_weights(seed: int) -> np.ndarray:
    """uint64 weights (KEY_HEAD_TOKENS + KEY_TAIL_TOKENS + 1,) keyed by ``seed``."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x736D656C74]))  # "smelt"
    return rng.integers(0, np.iinfo(np.uint64).max, KEY_HEAD_TOKENS + KEY_TAIL_TOKENS + 1, dtype=np.uint64,
                        endpoint=True) | np.uint64(1)


def content_keys(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seed: int) -> np.ndarray:
    """A keyed 64-bit hash of each document's content, (n,) uint64.

    Hashes the content length and its first :data:`KEY_HEAD_TOKENS` and last
    :data:`KEY_TAIL_TOKENS` token ids (every id when shorter; a bounded read per document):
    ``splitmix64_finish(sum_slot (id + 1) * w_slot + length * w_len)`` mod 2^64 with odd weights
    ``w`` drawn from a generator seeded by ``seed``. Ids are taken as integers, so the same
    document stored as uint16 or uint32, in any file, at any offset, gets the same key.
    """
    w = _key_weights(seed)
    return np.concatenate([_keys(tokens, starts[a:a + _CHUNK_KEYS], lengths[a:a + _CHUNK_KEYS], w)
                           for a in range(0, len(starts), _CHUNK_KEYS)] or [np.empty(0, np.uint64)])


def _keys(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, w: np.ndarray) -> np.ndarray:
    head, tail = KEY_HEAD_TOKENS, KEY_TAIL_TOKENS
    q = np.arange(head + tail)
    ln = lengths[:, None]
    pos = np.where(q < head, q, ln - (head + tail) + q)  # (n, K) position in the document
    valid = np.where(q < head, q < ln, pos >= head)  # a tail slot inside the head is not counted twice
    ids = tokens[starts[:, None] + np.where(valid, pos, 0)].astype(np.uint64) + np.uint64(1)
    ids[~valid] = 0
    acc = (ids * w[:head + tail]).sum(axis=1, dtype=np.uint64) + lengths.astype(np.uint64) * w[-1]
    return _splitmix64_finish(acc)


def select_smallest(keys: np.ndarray, n: int) -> tuple[int, int]:
    """``(t, ties)`` such that the ``n`` smallest of ``keys`` (ties: the earlier) are the keys
    below ``t`` and the first ``ties`` keys equal to ``t``, as ``argsort(keys, stable)[:n]``.

    Two chunked passes over ``keys`` (a memory map is fine): a histogram of the top 16 bits,
    then the keys of the one bucket that holds the n-th smallest (about len(keys) / 65,536 of
    them for hash keys). ``0 < n <= len(keys)``.
    """
    shift = np.uint64(48)
    hist = np.zeros(1 << 16, dtype=np.int64)
    for a in range(0, len(keys), CHUNK_TOKENS):
        hist += np.bincount((np.asarray(keys[a:a + CHUNK_TOKENS]) >> shift).astype(np.int64), minlength=1 << 16)
    cum = np.cumsum(hist)
    bucket = int(np.searchsorted(cum, n))  # first bucket whose cumulative count reaches n
    below = int(cum[bucket - 1]) if bucket else 0
    cand = np.concatenate([k[(k >> shift) == bucket] for a in range(0, len(keys), CHUNK_TOKENS)
                           for k in [np.asarray(keys[a:a + CHUNK_TOKENS])]])
    t = np.partition(cand, n - below - 1)[n - below - 1]
    return int(t), n - below - int((cand < t).sum())
