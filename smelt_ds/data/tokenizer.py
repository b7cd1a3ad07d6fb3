"""Byte-level BPE tokenizer: training with ``tokenizers``, loading, hashing, caching.

The tokenizer is GPT-2 style byte-level BPE (``ByteLevel`` pre-tokenizer without a prefix space,
``ByteLevel`` decoder, the 256 byte symbols as initial alphabet, so any text encodes without an
unknown token). Special tokens: end-of-text (id 0) and padding (id 1). Training is deterministic
for the same documents in the same order and the same settings.

The tokenizer hash is the sha256 of ``Tokenizer.to_str()`` (the canonical JSON ``tokenizers``
writes), so it does not depend on file formatting. Trained tokenizers are cached under
``<cache>/tokenizers/<key>/tokenizer.json`` where the key hashes the inputs' identities and the
settings: a rerun with the same inputs and settings does not retrain.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from smelt_ds.data.cache import build_dir_atomically, sha256_bytes, sha256_json
from smelt_ds.data.config import TokenizerConfig
from smelt_ds.errors import ConfigError

__all__ = ["TOKENIZER_FILE", "train_tokenizer", "tokenizer_hash", "load_tokenizer", "special_ids",
           "tokenizer_key", "cached_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"


def train_tokenizer(batches: Iterable[list[str]], cfg: TokenizerConfig) -> Tokenizer:
    """Train a byte-level BPE on batches of documents.

    Args:
        batches: lists of document texts, in a fixed order (the order changes tie-breaks).
        cfg: ``vocab_size`` (tokens, the 2 special tokens included), ``min_frequency``
            (occurrences), ``eot_token`` and ``pad_token`` (ids 0 and 1).

    Returns the trained tokenizer. Its vocabulary can be smaller than ``vocab_size`` when the text
    has fewer distinct mergeable pairs (read ``get_vocab_size()``).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=[cfg.eot_token, cfg.pad_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(batches, trainer=trainer)
    return tok


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 (hex) of the tokenizer's canonical JSON (``to_str()``)."""
    return sha256_bytes(tok.to_str().encode("utf-8"))


def load_tokenizer(path: str | Path, where: str = "tokenizer") -> Tokenizer:
    """Load a ``tokenizer.json``. Raises ConfigError naming ``where`` for a missing or bad file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"`{where}` ({str(path)!r}): no such tokenizer file: give the path of a "
                          "tokenizer.json, or unset it to train one")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a plain Exception for bad JSON
        raise ConfigError(f"`{where}` ({str(path)!r}) is not a tokenizers JSON file ({e}): "
                          "save it with Tokenizer.save() or train one with `smelt-ds data tokenizer`") from None


def special_ids(tok: Tokenizer, cfg: TokenizerConfig, where: str = "data.tokenizer") -> tuple[int, int]:
    """Ids of the end-of-text and padding tokens. Raises ConfigError if the vocabulary lacks one."""
    ids = []
    for name in ("eot_token", "pad_token"):
        token = getattr(cfg, name)
        tid = tok.token_to_id(token)
        if tid is None:
            raise ConfigError(f"`{where}.{name}` ({token!r}) is not in the tokenizer's vocabulary: "
                              f"set {where}.{name} to one of its special tokens, or train a tokenizer "
                              "with `smelt-ds data tokenizer`")
        ids.append(tid)
    return ids[0], ids[1]


def tokenizer_key(input_fingerprints: list[str], cfg: TokenizerConfig) -> str:
    """Cache key: the inputs' fingerprints (in order), the settings and the tokenizers version."""
    settings = cfg.model_dump(mode="json", exclude={"path"})
    return sha256_json({"inputs": input_fingerprints, "settings": settings, "tokenizers": tokenizers.__version__})


def capped_batches(batches: Iterable[list[str]], max_bytes: int | None) -> Iterator[list[str]]:
    """Pass documents through, in order, until the next one would pass ``max_bytes`` UTF-8 bytes
    (the first document always passes)."""
    total = 0
    for batch in batches:
        if max_bytes is None:
            yield batch
            continue
        kept = []
        for text in batch:
            size = len(text.encode("utf-8"))
            if total + size > max_bytes and total > 0:
                if kept:
                    yield kept
                return
            kept.append(text)
            total += size
        yield kept


def cached_tokenizer(root: Path, key: str, batches: Callable[[], Iterable[list[str]]],
                     cfg: TokenizerConfig) -> tuple[Path, bool]:
    """``<root>/tokenizers/<key>/tokenizer.json``, trained from ``batches()`` unless cached.

    Returns the file path and whether this call trained it.
    """
    out = root / "tokenizers" / key[:20]

    def build(tmp: Path) -> None:
        tok = train_tokenizer(capped_batches(batches(), cfg.max_train_bytes), cfg)
        tok.save(str(tmp / TOKENIZER_FILE))

    trained = build_dir_atomically(out, build)
    return out / TOKENIZER_FILE, trained


def copy_tokenizer(src: Path, dst: str | Path) -> Path:
    """Copy a tokenizer file to ``dst`` (a file path); returns ``dst``."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst
