"""A prepared data directory, read: :class:`PreparedData` (its metadata, shards and tokenizer) and
:func:`check_compatible` (shards, tokenizer and model agree). The loaders, evaluation and the studies read
prepared data through it; :mod:`smelt_ds.data.prepare` writes it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from smelt_ds.data.cache import (
    is_complete,
    sha256_file,
    sha256_json,
)
from smelt_ds.data.token_sources import (
    PackedStream,
    PackedTokens,
    check_token_file_ids,
    relocate_token_files,
    verify_token_files,
)
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import TOKENIZER_FILE, tokenizer_hash

if TYPE_CHECKING:
    from smelt_ds.config.data import SourceConfig

__all__ = ["FORMAT_VERSION", "META_FILE", "SPLITS", "PreparedData", "check_compatible"]

FORMAT_VERSION = 1  # of meta.json and the shards; another is refused (prepare the data again)
META_FILE = "meta.json"
SPLITS = ("train", "validation")


@dataclass
class PreparedData:
    """A prepared directory: metadata, tokenizer and token shards (numpy memmaps).

    ``created`` is True when this process prepared it (False when it was reused or another rank
    prepared it).
    """

    root: Path
    meta: dict
    created: bool = False
    _streams: dict[str, PackedStream] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, root: str | Path, verify: str = "checksum",
             sources: list[SourceConfig] | None = None) -> PreparedData:
        """Open a prepared directory and check it.

        ``verify``: ``"checksum"`` (sizes and sha256 of every shard) or ``"size"``. ``sources``
        (the recipe's ``data.sources``): read the user files of token sources where these sources
        find them now, which may not be where they were prepared
        (:func:`~smelt_ds.data.token_sources.relocate_token_files`).
        Raises ConfigError for an incomplete directory, a tokenizer that does not match the
        metadata, or a missing, truncated or modified shard.
        """
        root = Path(root)
        if not is_complete(root):
            raise ConfigError(f"prepared directory {str(root)!r} is missing or incomplete (no _COMPLETE marker): "
                              "run `smelt-ds data prepare` (a partial output is never used)")
        try:
            prepared = cls(root, json.loads((root / META_FILE).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{str(root / META_FILE)!r} cannot be read ({e}): the prepared directory is damaged; "
                              "delete it and prepare again") from None
        if prepared.meta.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{str(root / META_FILE)!r}: format_version {prepared.meta.get('format_version')} "
                              f"is not {FORMAT_VERSION}: prepare the data again with this smelt-ds")
        if sources is not None:
            relocate_token_files(prepared.meta, sources)
        prepared.verify(verify)
        return prepared

    # -- metadata views ----------------------------------------------------------------------
    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def tokenizer_hash(self) -> str:
        return self.meta["tokenizer"]["sha256"]

    @property
    def train_digest(self) -> str:
        """SHA-256 (hex, 16 characters) of what the train split holds: each train shard's file,
        token count and sha256, and the user token files it reads (``token_files``: path, size,
        modification time, sampled sha256). A preparation rebuilt under the same key (a token file
        changed in place) has another digest; the creation time and library versions are not in it."""
        shards = [[s["file"], s["tokens"], s.get("sha256"), s.get("stream"), s.get("offset")]
                  for s in self.meta["shards"] if s["split"] == "train"]
        return sha256_json([shards, self.meta.get("token_files", [])])[:16]

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the tokenizer (tokens)."""
        return self.meta["tokenizer"]["vocab_size"]

    @property
    def eot_id(self) -> int:
        return self.meta["tokenizer"]["eot_id"]

    @property
    def pad_id(self) -> int:
        return self.meta["tokenizer"]["pad_id"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def domains(self) -> list[str]:
        """Domains in source order."""
        return list(dict.fromkeys(s["domain"] for s in self.meta["sources"]))

    def shards(self, split: str, domain: str | None = None, source: int | None = None) -> list[dict]:
        """Shard records of ``split`` (optionally one domain or source), in metadata order."""
        return [s for s in self.meta["shards"] if s["split"] == split
                and (domain is None or s["domain"] == domain) and (source is None or s["source"] == source)]

    def tokens(self, shard: dict) -> np.memmap | PackedTokens:
        """Token ids of a shard, shape (shard["tokens"],): a read-only memmap of a text source's
        shard, or a :class:`~smelt_ds.data.token_sources.PackedTokens` view of a token source's
        virtual shard (slicing it reads that range of the user's files, as a uint32 array)."""
        if shard.get("stream") is None:
            return np.memmap(self.root / shard["file"], dtype=self.dtype, mode="r", shape=(shard["tokens"],))
        name = shard["stream"]
        if name not in self._streams:
            self._streams[name] = PackedStream(self.root, self.meta["streams"][name], self.meta["token_files"],
                                               self.eot_id)
        return PackedTokens(self._streams[name], shard["offset"], shard["tokens"])

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.root / TOKENIZER_FILE))

    # -- checks --------------------------------------------------------------------------------
    def verify(self, level: str = "checksum") -> None:
        """Check the tokenizer hash and every shard's size (and sha256 with ``level="checksum"``);
        for token sources, their files' sizes (and sampled sha256) and stream indexes
        (:func:`~smelt_ds.data.token_sources.verify_token_files`)."""
        tok_hash = tokenizer_hash(self.tokenizer())
        if tok_hash != self.tokenizer_hash:
            raise ConfigError(f"{str(self.root / TOKENIZER_FILE)!r}: tokenizer hash {tok_hash[:12]} does not match "
                              f"meta.json ({self.tokenizer_hash[:12]}): the directory was modified; prepare again")
        for shard in self.meta["shards"]:
            if shard.get("stream") is None:
                self._verify_shard(shard, level)
        verify_token_files(self.root, self.meta, level)

    def _verify_shard(self, shard: dict, level: str) -> None:
        path = self.root / shard["file"]
        if not path.is_file():
            raise ConfigError(f"shard {str(path)!r} is missing (meta.json lists it with {shard['tokens']} tokens of "
                              f"{self.meta['dtype']}, {shard['bytes']} bytes): the prepared directory is damaged; "
                              "delete it and prepare again")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise ConfigError(f"shard {str(path)!r} has {size} bytes, meta.json says {shard['bytes']} "
                              f"({shard['tokens']} tokens of {self.meta['dtype']}): the shard is "
                              "truncated or was overwritten; delete the prepared directory and prepare again")
        if level == "checksum" and (digest := sha256_file(path)) != shard["sha256"]:
            raise ConfigError(f"shard {str(path)!r}: sha256 {digest[:12]} does not match meta.json "
                              f"({shard['sha256'][:12]}): the shard was modified; delete the prepared directory "
                              "and prepare again")

    def summary(self) -> str:
        """A table of documents and tokens per split and domain."""
        lines = [f"prepared {self.root}", f"tokenizer {self.tokenizer_hash[:16]}  vocab {self.vocab_size}  "
                 f"dtype {self.meta['dtype']}  eot id {self.eot_id}",
                 f"{'split':<11}{'domain':<16}{'documents':>11}{'tokens':>13}"]
        for split, per_domain in self.meta["splits"].items():
            for domain, c in per_domain.items():
                lines.append(f"{split:<11}{domain:<16}{c['documents']:>11,}{c['tokens']:>13,}")
        for s in self.meta["sources"]:
            skipped = {k: v for k, v in s["skipped"].items() if v}
            lines.append(f"source {s['index']} {s['label']}: {s['documents']:,} documents, skipped {skipped or 0}, "
                         f"invalid UTF-8 replaced {s['replaced_invalid_utf8']}")
        return "\n".join(lines)


def check_compatible(prepared: PreparedData, model_vocab_size: int, tokenizer_hash: str | None = None) -> None:
    """Check that shards, tokenizer and model agree. Raises ConfigError naming both values.

    - the tokenizer's vocabulary (tokens) is at most ``model_vocab_size`` (``model.vocab_size``; a
      larger model vocabulary is a padded one, as Megatron-LM pads to a multiple of 128 and
      Qwen3-MoE's 151,936 rows hold a 151,669-token tokenizer); the fix named is a larger
      ``model.vocab_size`` when the tokenizer was given (``data.tokenizer.path``), else also a
      smaller trained tokenizer;
    - every token id in the shards is below ``model_vocab_size`` (for token sources, the largest id
      of each file, from the manifest, naming the file; checked first);
    - when given, ``tokenizer_hash`` (e.g. from a checkpoint) equals the shards' tokenizer hash.
    """
    for f in prepared.meta.get("token_files", []):  # token sources: name the user's file
        check_token_file_ids(f["name"], f"data.sources[{f['source']}]", f["max_token_id"], model_vocab_size)
    if prepared.vocab_size > model_vocab_size:
        given = prepared.meta.get("config", {}).get("tokenizer", {}).get("path")
        padded = -(-prepared.vocab_size // 128) * 128
        fix = (f"set model.vocab_size to at least {prepared.vocab_size} (e.g. {padded}, padded to a multiple of 128 "
               f"as Megatron-LM does): the tokenizer is the one given in data.tokenizer.path ({given!r}), so its size "
               "is fixed" if given else
               f"set model.vocab_size to {prepared.vocab_size}, or prepare the data with "
               f"data.tokenizer.vocab_size={model_vocab_size}")
        raise ConfigError(f"`model.vocab_size` ({model_vocab_size}) is smaller than the tokenizer of the prepared "
                          f"data ({prepared.vocab_size} tokens, tokenizer {prepared.tokenizer_hash[:12]}, "
                          f"{prepared.root}): {fix}")
    top = max((s["max_token_id"] for s in prepared.meta["shards"]), default=-1)
    if top >= model_vocab_size:
        raise ConfigError(f"prepared shards hold token id {top}, not below `model.vocab_size` ({model_vocab_size}): "
                          "the shards were made with another tokenizer; prepare the data again")
    if tokenizer_hash is not None and tokenizer_hash != prepared.tokenizer_hash:
        raise ConfigError(f"tokenizer hash {tokenizer_hash[:12]} (expected, e.g. from the checkpoint) does not "
                          f"match the prepared data's tokenizer {prepared.tokenizer_hash[:12]} ({prepared.root}): "
                          "prepare the data with the checkpoint's tokenizer (data.tokenizer.path)")
