"""Helpers of the data-pipeline tests (imported by the test modules as ``data_test_utils``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CORPORA = Path(__file__).resolve().parent / "corpora"  # slices of public corpora: corpora/README.md
WIKITEXT = CORPORA / "wikitext-2-valid-head.txt"
SHAKESPEARE = CORPORA / "tinyshakespeare-head.txt"
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def require(path: Path) -> Path:
    """``path``, a corpus slice the repository ships; a clear failure when it is missing."""
    if not path.is_file():
        pytest.fail(f"test corpus {path} is missing: it is part of the repository (tests/data/corpora/README.md "
                    "says how to regenerate it)")
    return path


def builtin_documents(prepared_cache: Path, domain: str) -> list[str]:
    """Documents of a built-in domain read straight from its JSONL file."""
    (corpus,) = (prepared_cache / "builtin").iterdir()
    return [json.loads(line)["text"] for line in (corpus / f"{domain}.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def prose(n: int, seed: int = 0) -> list[str]:
    """``n`` short documents of real prose (paragraphs of CPython's pydoc topics), cycled."""
    from pydoc_data.topics import topics

    paras = [p for name in sorted(topics) for p in PARAGRAPH_BREAK.split(topics[name]) if len(p) > 80]
    return [paras[(seed + i * 7) % len(paras)] for i in range(n)]


def encode_documents(tokenizer_path: Path, docs: list[str], eot_id: int) -> list[list[int]]:
    """Each document encoded directly with ``tokenizers`` (special-token text as plain text) + end-of-text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.encode_special_tokens = True
    return [enc.ids + [eot_id] for enc in tok.encode_batch(docs)]


def split_at_eot(stream, eot_id: int) -> list[list[int]]:
    """A token stream cut after every end-of-text id; the stream must end with one."""
    import numpy as np

    ids = np.asarray(stream, dtype=np.int64)
    assert ids.size == 0 or ids[-1] == eot_id, "stream does not end with end-of-text"
    cuts = np.flatnonzero(ids == eot_id) + 1
    return [part.tolist() for part in np.split(ids, cuts[:-1])] if ids.size else []


def assign_documents(expected: list[list[int]], train: list[list[int]], valid: list[list[int]]) -> list[bool]:
    """Walk the expected documents in order; each must be the next train or the next validation
    document. Returns the validation mask; fails if a document is missing, extra or altered."""
    i = j = 0
    mask = []
    for doc in expected:
        if i < len(train) and train[i] == doc:
            i, _ = i + 1, mask.append(False)
        elif j < len(valid) and valid[j] == doc:
            j, _ = j + 1, mask.append(True)
        else:
            raise AssertionError(f"document {len(mask)} is neither the next train nor the next validation document")
    assert (i, j) == (len(train), len(valid)), "shards hold documents that are not in the source"
    return mask


# --------------------------------------------------------------------------------------------
# WikiText-2 (one document per non-blank line) and Tiny Shakespeare (one per paragraph)
# --------------------------------------------------------------------------------------------

WIKI_DOCS, SHAK_DOCS = 1500, 800


def wiki_documents() -> list[str]:
    """The first WIKI_DOCS non-blank lines of WikiText-2 valid, read directly."""
    lines = require(WIKITEXT).read_text(encoding="utf-8").split("\n")
    return [line for line in lines if line.strip()][:WIKI_DOCS]


def shakespeare_documents() -> list[str]:
    """The first SHAK_DOCS blank-line-separated paragraphs of Tiny Shakespeare, read directly."""
    paras = PARAGRAPH_BREAK.split(require(SHAKESPEARE).read_text(encoding="utf-8"))
    return [p for p in paras if p.strip()][:SHAK_DOCS]


def two_domain_config(tmp_path: Path, **extra):
    """WikiText-2 (domain wiki) and Tiny Shakespeare (domain shakespeare), 400-token vocabulary."""
    from smelt_ds.config.data import DataConfig

    return DataConfig(sources=[
        {"path": str(require(WIKITEXT)), "sample_by": "line", "domain": "wiki", "max_documents": WIKI_DOCS},
        {"path": str(require(SHAKESPEARE)), "sample_by": "paragraph", "domain": "shakespeare",
         "max_documents": SHAK_DOCS}],
        tokenizer={"vocab_size": 400}, validation_share=0.1, cache_dir=str(tmp_path / "cache"), **extra)
