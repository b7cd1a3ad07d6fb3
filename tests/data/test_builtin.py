"""The built-in corpus: deterministic, capped, two disjoint domains of real CPython text."""

from __future__ import annotations

import hashlib
import json
import sys
from pydoc_data.topics import topics

import pytest

from smelt_ds.cli import main
from smelt_ds.data.builtin import DEFAULT_MAX_BYTES, build_builtin_corpus, load_manifest, stdlib_dir


def read(corpus, domain):
    return [json.loads(line) for line in (corpus / f"{domain}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
def test_same_python_same_corpus_same_hash(builtin_prepared, session_cache, tmp_path):
    (cached,) = (session_cache / "builtin").iterdir()  # built by the session's first preparation
    fresh = build_builtin_corpus(tmp_path / "fresh")
    assert fresh["domains"] == load_manifest(cached)["domains"]
    for domain in ("code", "text"):
        assert (tmp_path / "fresh" / f"{domain}.jsonl").read_bytes() == (cached / f"{domain}.jsonl").read_bytes()


def test_manifest_counts_match_the_files(tmp_path):
    manifest = build_builtin_corpus(tmp_path, max_bytes=300_000)
    for domain, info in manifest["domains"].items():
        raw = (tmp_path / info["file"]).read_bytes()
        docs = read(tmp_path, domain)
        assert info["sha256"] == hashlib.sha256(raw).hexdigest()
        assert info["documents"] == len(docs) > 0
        assert info["bytes"] == sum(len(d["text"].encode("utf-8")) for d in docs) <= 300_000
        assert all(d["domain"] == domain and d["source"] for d in docs)


def test_documents_are_real_cpython_text(builtin_prepared, session_cache):
    (corpus,) = (session_cache / "builtin").iterdir()
    code, text = read(corpus, "code"), read(corpus, "text")
    root = stdlib_dir()
    for doc in code[:10]:
        rel = doc["source"].removeprefix("stdlib:")
        assert doc["text"] == (root / rel).read_text(encoding="utf-8")
    first_topic = sorted(topics)[0]
    assert text[0] == {"text": topics[first_topic], "domain": "text", "source": f"pydoc_data.topics:{first_topic}"}
    assert 0.5e6 < sum(len(d["text"]) for d in code) <= DEFAULT_MAX_BYTES
    code_modules = {d["source"].removeprefix("stdlib:") for d in code}
    docstring_modules = {d["source"].removeprefix("docstrings:") for d in text if d["source"].startswith("docstrings:")}
    assert docstring_modules and not code_modules & docstring_modules  # no module in both domains


def test_smaller_cap_gives_a_prefix(builtin_prepared, session_cache, tmp_path):
    (corpus,) = (session_cache / "builtin").iterdir()
    build_builtin_corpus(tmp_path, max_bytes=200_000)
    for domain in ("code", "text"):
        small, full = read(tmp_path, domain), read(corpus, domain)
        assert 0 < len(small) < len(full) and small == full[:len(small)]


def test_cli_prints_documents_mb_and_hash(tmp_path, capsys):
    assert main(["data", "builtin", str(tmp_path / "c"), "--max-bytes", "150000"]) == 0
    out = capsys.readouterr().out
    manifest = load_manifest(tmp_path / "c")
    for domain, info in manifest["domains"].items():
        line = next(line for line in out.splitlines() if line.startswith(domain))
        assert line.split() == [domain, f"{info['documents']:,}", f"{info['bytes'] / 1e6:.3f}", info["sha256"]]
    assert f"Python {sys.version.split()[0]}" in out
