"""A ``tokenizer.json``: its file name, loading (a file or a transformers tokenizer directory) and
identity, the SHA-256 of ``Tokenizer.to_str()`` (the canonical JSON ``tokenizers`` writes, so it
does not depend on file formatting).

Every artifact of a run carries its tokenizer under :data:`TOKENIZER_FILE` and is checked by this
identity (:mod:`smelt_ds.runs.provenance`); the data pipeline (:mod:`smelt_ds.data.tokenizer`,
:mod:`smelt_ds.data.prepare`) writes and reads prepared data's tokenizer with the same helpers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenizers import Tokenizer

from smelt_ds.errors import ConfigError
from smelt_ds.files import relative_rule

__all__ = ["TOKENIZER_FILE", "tokenizer_hash", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 (hex) of the tokenizer's canonical JSON (``to_str()``)."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def load_tokenizer(path: str | Path, where: str = "tokenizer") -> Tokenizer:
    """Load a ``tokenizer.json``, or a transformers tokenizer directory (``AutoTokenizer``, its fast
    backend ``tokenizers.Tokenizer``). Raises ConfigError naming ``where`` for a missing or bad one."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _transformers_backend(p, where)
    if not p.is_file():
        raise ConfigError(f"`{where}` ({str(path)!r}): no such tokenizer file or directory ({relative_rule(path)}): "
                          "give the path of a tokenizer.json or of a transformers tokenizer directory, or unset it to "
                          "train one")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a plain Exception for bad JSON
        raise ConfigError(f"`{where}` ({str(path)!r}) is not a tokenizers JSON file ({e}): "
                          "save it with Tokenizer.save() or train one with `smelt-ds data tokenizer`") from None


def _transformers_backend(directory: Path, where: str) -> Tokenizer:
    """The fast backend of ``AutoTokenizer.from_pretrained(directory)`` (local files only)."""
    import transformers  # seconds to import: only for a tokenizer directory

    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a bad directory
        raise ConfigError(f"`{where}` ({str(directory)!r}): transformers.AutoTokenizer cannot load this directory "
                          f"({type(e).__name__}: {e}): give a directory written by save_pretrained, or a "
                          "tokenizer.json") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if not getattr(tok, "is_fast", False) or not isinstance(backend, Tokenizer):
        raise ConfigError(f"`{where}` ({str(directory)!r}): {type(tok).__name__} is a slow tokenizer without a "
                          "`tokenizers` backend: convert it (AutoTokenizer.from_pretrained(dir, use_fast=True)"
                          ".save_pretrained(dir) writes tokenizer.json) and give that directory")
    return backend
