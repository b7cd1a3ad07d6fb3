"""Byte-level BPE tokenizer: training with ``tokenizers``, caching (loading a ``tokenizer.json`` and
its hash: :mod:`smelt_ds.runs.tokenizer_file`, shared with the run directory).

The tokenizer is GPT-2 style byte-level BPE (``ByteLevel`` pre-tokenizer without a prefix space,
``ByteLevel`` decoder, the 256 byte symbols as initial alphabet, so any text encodes without an
unknown token). Special tokens: end-of-text (id 0) and padding (id 1). Training is deterministic
for the same documents in the same order and the same settings.

The tokenizer hash (:func:`smelt_ds.runs.tokenizer_file.tokenizer_hash`) is the sha256 of
``Tokenizer.to_str()`` (the canonical JSON ``tokenizers`` writes), so it does not depend on file
formatting. Trained tokenizers are cached under
``<cache>/tokenizers/<key>/tokenizer.json`` where the key hashes the inputs' identities and the
settings: a rerun with the same inputs and settings does not retrain.

Long documents are handed to ``tokenizers`` in pieces (:func:`cut_document`): its memory grows
with the length of each text it gets in one call (up to about 200 bytes per byte: offsets and
alignments per byte), so a 50 MB single-line document needed about 8 GB. Pieces are cut just
before a whitespace character that has non-whitespace on both sides; the GPT-2 pre-tokenizer
always separates words there, so for the byte-level BPE trained here (no normalizer) the pieces
give exactly the words (training) and ids (encoding) of the whole text. Documents are encoded with
``add_special_tokens=False``: a post-processor's template (the BOS an HF ``tokenizer.json`` adds,
e.g. one written by ``smelt-ds export --format hf``) never enters the token stream, where
documents are separated by end-of-text alone.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from smelt_ds.config.data import TokenizerConfig
from smelt_ds.data.cache import build_dir_atomically, is_complete, sha256_json
from smelt_ds.data.distributed import rank_info
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import TOKENIZER_FILE, load_tokenizer

__all__ = ["train_tokenizer", "special_ids", "tokenizer_key", "cached_tokenizer", "utf8_len", "cut_document",
           "cut_batches", "cut_problem", "UncuttableDocument", "write_tokenizer_file", "tokenizer_id_space",
           "unused_vocab_size"]


def train_tokenizer(batches: Iterable[list[str]], cfg: TokenizerConfig) -> Tokenizer:
    """Train a byte-level BPE on batches of documents.

    Args:
        batches: lists of document texts, in a fixed order (the order changes tie-breaks).
        cfg: ``vocab_size`` (tokens, the 2 special tokens included), ``min_frequency``
            (occurrences), ``eot_token`` and ``pad_token`` (ids 0 and 1).

    Returns the trained tokenizer, with exactly ``cfg.vocab_size`` tokens. Raises ConfigError when
    the text has too few distinct pairs seen ``min_frequency`` times to reach ``cfg.vocab_size``
    (``model.vocab_size`` must equal the tokenizer's, so a smaller vocabulary is never returned);
    the message gives the size the text supports.
    """
    seen = {"documents": 0, "bytes": 0}

    def counted() -> Iterator[list[str]]:
        for batch in batches:
            seen["documents"] += len(batch)
            seen["bytes"] += sum(utf8_len(t) for t in batch)
            yield batch

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=[cfg.eot_token, cfg.pad_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(counted(), trainer=trainer)
    got = tok.get_vocab_size()
    if got < cfg.vocab_size:
        raise ConfigError(
            f"`data.tokenizer.vocab_size` ({cfg.vocab_size}): the training text ({seen['bytes']:,} UTF-8 bytes in "
            f"{seen['documents']:,} documents or pieces) supports only {got:,} tokens with "
            f"min_frequency={cfg.min_frequency} (no more pairs occur that often): set "
            f"data.tokenizer.vocab_size={got} (--vocab-size {got}) or less and model.vocab_size to the same value, "
            "add text, or lower data.tokenizer.min_frequency")
    return tok


def write_tokenizer_file(path: str | Path, dst: Path) -> None:
    """Write the tokenizer at ``path`` (file: copied as is; directory: its backend saved) to ``dst``."""
    p = Path(path).expanduser()
    if p.is_dir():
        load_tokenizer(p).save(str(dst))
    else:
        shutil.copyfile(p, dst)


def tokenizer_id_space(tok: Tokenizer) -> int:
    """The largest id of the tokenizer (added tokens included) + 1. A vocabulary can be small but
    sparse, so ``get_vocab_size()`` is not always the largest id + 1."""
    return 1 + max(tok.get_vocab_size() - 1, max(tok.get_vocab(with_added_tokens=True).values(), default=-1))


def unused_vocab_size(cfg: TokenizerConfig, size: int, model_vocab_size: int) -> str | None:
    """Why ``data.tokenizer.vocab_size`` has no effect for a recipe with ``data.tokenizer.path``
    (a tokenizer of ``size`` tokens), or None.

    The field sizes a tokenizer trained from the sources; with ``path`` set nothing is trained and
    the loaded tokenizer's vocabulary is used. A value the recipe does not set (the default), one
    equal to ``size``, or one equal to ``model_vocab_size`` (``model.vocab_size``, which the
    shipped recipes repeat there and which the tokenizer is checked against anyway) says nothing
    wrong; any other value asks for a vocabulary the run will not have. Returns the message
    naming both fields, both sizes and the fix (a warning: the run itself is unaffected)."""
    if cfg.path is None or "vocab_size" not in cfg.model_fields_set or cfg.vocab_size in (size, model_vocab_size):
        return None
    return (f"`data.tokenizer.vocab_size` ({cfg.vocab_size}) is not used: `data.tokenizer.path` ({str(cfg.path)!r}) "
            f"gives the tokenizer, of {size} tokens (data.tokenizer.vocab_size only sizes a tokenizer trained from "
            f"the sources): to keep this tokenizer, remove data.tokenizer.vocab_size from the recipe or set it to "
            f"{size}; to train one of {cfg.vocab_size} tokens, unset data.tokenizer.path (--set "
            "data.tokenizer.path=null)")


def special_ids(tok: Tokenizer, cfg: TokenizerConfig, where: str = "data.tokenizer") -> tuple[int, int]:
    """Ids of the end-of-text and padding tokens. Raises ConfigError if the vocabulary lacks one."""
    ids = []
    for name in ("eot_token", "pad_token"):
        token = getattr(cfg, name)
        tid = tok.token_to_id(token)
        if tid is None:
            specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
            raise ConfigError(f"`{where}.{name}` ({token!r}) is not in the tokenizer's vocabulary: "
                              f"set {where}.{name} to one of its special tokens ({specials[:12] or 'it has none'}), "
                              "or train a tokenizer with `smelt-ds data tokenizer`")
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
        kept: list[str] = []
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
                     cfg: TokenizerConfig, max_piece_bytes: int | None = None) -> tuple[Path, bool]:
    """``<root>/tokenizers/<key>/tokenizer.json``, trained from ``batches()`` unless cached.

    Documents are capped by ``cfg.max_train_bytes`` and then cut into pieces of at most
    ``max_piece_bytes`` UTF-8 bytes (:func:`cut_batches`; the same tokenizer as without cutting).
    Returns the file path and whether this call trained it; nothing is cached when training fails.
    """
    out = root / "tokenizers" / key[:20]
    if rank_info().rank == 0:  # what is happening (rank 0's stderr): the first run trains, later ones reuse
        if is_complete(out):
            print(f"smelt-ds data: reusing the BPE tokenizer cached in {out}", file=sys.stderr, flush=True)
        else:
            cap = f"up to {cfg.max_train_bytes:,} bytes" if cfg.max_train_bytes else "all"
            print(f"smelt-ds data: training the BPE tokenizer now (vocab_size {cfg.vocab_size:,}, on {cap} of the "
                  f"documents); cached afterwards in {out}", file=sys.stderr, flush=True)

    def build(tmp: Path) -> None:
        docs = capped_batches(batches(), cfg.max_train_bytes)
        tok = train_tokenizer(cut_batches(docs, max_piece_bytes) if max_piece_bytes else docs, cfg)
        tok.save(str(tmp / TOKENIZER_FILE))

    trained = build_dir_atomically(out, build)
    return out / TOKENIZER_FILE, trained


# --------------------------------------------------------------------------------------------
# long documents: pieces of bounded size
# --------------------------------------------------------------------------------------------

# a whitespace character with a non-whitespace character on both sides. Python's \s (str.isspace)
# contains every character Unicode calls White_Space, so a \S here is non-whitespace for the
# pre-tokenizer's regex too.
_CUT_POINT = re.compile(r"(?<=\S)\s(?=\S)")


class UncuttableDocument(ConfigError):
    """A document with a stretch longer than the piece size that has no cut point."""

    def __init__(self, doc_bytes: int, start: int, max_bytes: int, preview: str):
        self.doc_bytes, self.start, self.max_bytes = doc_bytes, start, max_bytes
        super().__init__(f"a document of {doc_bytes:,} UTF-8 bytes has no whitespace between two non-whitespace "
                         f"characters within the {max_bytes:,} bytes from character {start:,} ({preview!r}...), so "
                         f"it cannot be cut into pieces of data.tokenize_chunk_bytes ({max_bytes}) for the tokenizer: "
                         "raise data.tokenize_chunk_bytes (tokenising takes up to about 200 bytes of memory per "
                         "byte of a piece), or remove the document (long stretches without spaces are rarely text)")


def utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes (lone surrogates, which JSON allows, count 3 bytes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prefix_end(text: str, start: int, max_bytes: int) -> int:
    """Largest ``end`` with ``utf8_len(text[start:end]) <= max_bytes`` (``max_bytes`` >= 4)."""
    hi = min(len(text), start + max_bytes)
    if utf8_len(text[start:hi]) <= max_bytes:
        return hi
    lo = start + max_bytes // 4  # a character has at most 4 bytes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if utf8_len(text[start:mid]) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def cut_document(text: str, max_bytes: int) -> list[str]:
    """``text`` as consecutive pieces of at most ``max_bytes`` UTF-8 bytes (``[text]`` if it fits).

    Each cut is made just before a whitespace character that has a non-whitespace character on
    both sides, as late as the size allows; ``"".join(pieces) == text``. Raises
    :class:`UncuttableDocument` when ``max_bytes`` bytes pass without such a character.
    """
    size = utf8_len(text)
    if size <= max_bytes:
        return [text]
    pieces, start = [], 0
    while True:
        end = _prefix_end(text, start, max_bytes)
        if end == len(text):
            pieces.append(text[start:])
            return pieces
        cut = None
        for m in _CUT_POINT.finditer(text, start + 1, end + 2):  # the cut character may sit at `end`
            if m.start() <= end:
                cut = m.start()
        if cut is None:
            raise UncuttableDocument(size, start, max_bytes, text[start:start + 40])
        pieces.append(text[start:cut])
        start = cut


def cut_batches(batches: Iterable[list[str]], max_bytes: int) -> Iterator[list[str]]:
    """Batches of documents with each document longer than ``max_bytes`` replaced by its pieces."""
    for batch in batches:
        if all(len(t) <= max_bytes // 4 or utf8_len(t) <= max_bytes for t in batch):
            yield batch
        else:
            yield [piece for t in batch for piece in cut_document(t, max_bytes)]


def cut_problem(tok: Tokenizer) -> str | None:
    """Why cutting a document may change this tokenizer's ids (None: pieces give exactly the ids
    of the whole text, as for the byte-level BPE trained by :func:`train_tokenizer`)."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is not None:
        return f"it has a normalizer ({spec['normalizer'].get('type')})"
    if not (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")):
        return (f"its pre-tokenizer is {pre.get('type')} {pre}, not ByteLevel(add_prefix_space=False, "
                "use_regex=True)")
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "it truncates or pads (per piece)"
    for t in spec.get("added_tokens", []):
        if not t.get("special") and (t.get("lstrip") or t.get("rstrip") or any(c.isspace() for c in t["content"])):
            return f"its added token {t['content']!r} may span or absorb whitespace"
    return None
