"""The built-in corpus: two domains built from the Python installation that runs it (no download).

- ``code``: ``.py`` source files of the standard library, whole files as documents.
- ``text``: prose written by people that ships with CPython: the documentation topics of
  ``pydoc_data.topics`` (the text of ``help('topic')``, one document per topic), ``LICENSE.txt``,
  IDLE's plain-text documents (``idlelib/*.txt``: README, NEWS, HISTORY, CREDITS, ...), then the
  docstrings of standard-library modules (one document per module: module, class and function
  docstrings in source order, modules with fewer than 200 characters of docstrings left out).

The two domains share no module: every standard-library file is assigned to ``code`` or to
``text`` (docstrings) by one bit of the sha256 of its relative path, so no prose appears in both.
Files are visited in sha256-of-path order (a fixed pseudo-random order that mixes packages) and
documents are taken until the next one would pass the cap of ``max_bytes`` UTF-8 bytes per
domain (default 2,000,000). Excluded: ``site-packages``, ``dist-packages``, ``test``/``tests``
packages, ``__pycache__``, files that are not UTF-8 or do not parse.

Deterministic: the same Python installation gives byte-identical JSONL files and hashes.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.data.cache import build_dir_atomically, cache_root, sha256_file, sha256_json, write_json

__all__ = ["BUILDER_VERSION", "DEFAULT_MAX_BYTES", "Document", "stdlib_dir", "builtin_key", "module_docstrings",
           "write_domain", "build_builtin_corpus", "builtin_corpus_dir", "load_manifest"]

BUILDER_VERSION = 1
DEFAULT_MAX_BYTES = 2_000_000
MIN_DOCSTRING_CHARS = 200
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Document:
    text: str
    domain: str
    source: str

    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def stdlib_dir() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def builtin_key(max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Cache key of the built-in corpus: interpreter version and location, cap, builder version."""
    return sha256_json({"python": sys.version, "stdlib": str(stdlib_dir()), "max_bytes": max_bytes,
                        "builder": BUILDER_VERSION})


def _path_hash(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest()


def _stdlib_files(root: Path) -> list[str]:
    """Relative paths of library ``.py`` files, in sha256-of-path order."""
    rels = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
            if not (set(p.relative_to(root).parts[:-1]) & EXCLUDED_DIRS)]
    return sorted(rels, key=_path_hash)


def _domain_of(rel: str) -> str:
    return "code" if _path_hash(rel)[0] % 2 == 0 else "text"


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _code_documents(root: Path, rels: list[str]) -> Iterator[Document]:
    for rel in rels:
        if _domain_of(rel) == "code" and (text := _read_utf8(root / rel)) and text.strip():
            yield Document(text, "code", f"stdlib:{rel}")


def module_docstrings(source: str) -> str:
    """Module, class and function docstrings of ``source`` in source order, cleaned, blank-line joined."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [n for n in ast.walk(tree) if isinstance(n, kinds)]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = [ast.get_docstring(n, clean=True) for n in nodes]
    return "\n\n".join(d for d in docs if d)


def _prose_files(root: Path) -> Iterator[Document]:
    topics: dict[str, str]
    try:
        from pydoc_data import topics as pydoc_topics
        topics = pydoc_topics.topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        yield Document(topics[name], "text", f"pydoc_data.topics:{name}")
    for path in [root / "LICENSE.txt"] + sorted((root / "idlelib").glob("*.txt")):
        if path.is_file() and (text := _read_utf8(path)) and text.strip():
            yield Document(text, "text", f"stdlib:{path.relative_to(root).as_posix()}")


def _text_documents(root: Path, rels: list[str]) -> Iterator[Document]:
    yield from _prose_files(root)
    for rel in rels:
        if _domain_of(rel) == "text" and (source := _read_utf8(root / rel)):
            doc = module_docstrings(source)
            if len(doc) >= MIN_DOCSTRING_CHARS:
                yield Document(doc, "text", f"docstrings:{rel}")


def _take_until(docs: Iterator[Document], max_bytes: int) -> list[Document]:
    """Documents in order until the next one would make the total pass ``max_bytes`` (bytes)."""
    out, total = [], 0
    for doc in docs:
        if total + doc.nbytes() > max_bytes:
            break
        out.append(doc)
        total += doc.nbytes()
    return out


def write_domain(out_dir: Path, domain: str, docs: list[Document]) -> dict:
    """Write ``<domain>.jsonl`` (one ``{"text", "domain", "source"}`` object per line) and return its
    ``file``, ``documents``, ``bytes`` (UTF-8 bytes of document text) and ``sha256``."""
    path = out_dir / f"{domain}.jsonl"
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"text": d.text, "domain": d.domain, "source": d.source}, ensure_ascii=False) + "\n")
    return {"file": path.name, "documents": len(docs), "bytes": sum(d.nbytes() for d in docs),
            "sha256": sha256_file(path)}


def build_builtin_corpus(out_dir: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Write ``code.jsonl``, ``text.jsonl`` and ``manifest.json`` into ``out_dir``.

    Each JSONL line is ``{"text", "domain", "source"}``; ``source`` names the file or topic.
    ``max_bytes`` caps each domain (UTF-8 bytes of document text). Returns the manifest:
    per domain ``documents``, ``bytes`` and ``sha256`` (of the JSONL file: the content hash).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = stdlib_dir()
    rels = _stdlib_files(root)
    domains = {"code": _take_until(_code_documents(root, rels), max_bytes),
               "text": _take_until(_text_documents(root, rels), max_bytes)}
    manifest = {"builder_version": BUILDER_VERSION, "python": sys.version, "stdlib": str(root),
                "max_bytes": max_bytes, "key": builtin_key(max_bytes),
                "domains": {name: write_domain(out, name, docs) for name, docs in domains.items()}}
    write_json(out / MANIFEST, manifest)
    return manifest


def load_manifest(corpus_dir: str | Path) -> dict:
    return json.loads((Path(corpus_dir) / MANIFEST).read_text())


def builtin_corpus_dir(cache_dir: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """The cached built-in corpus directory (``<cache>/builtin/<key>``), built on first use."""
    out = cache_root(cache_dir) / "builtin" / builtin_key(max_bytes)[:20]
    build_dir_atomically(out, lambda tmp: build_builtin_corpus(tmp, max_bytes))
    return out
