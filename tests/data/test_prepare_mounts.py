"""Data prepared once is reused wherever it is mounted: the preparation key depends on the files'
names, sizes and modification times, not on their paths, and a token source's files, read in
place, are read where the recipe finds them now.

A login node and the pods of a Kubernetes job see one volume at two paths. Here the second path
holds hard links to the same files (same inode: same content and modification time, as a second
mount of one filesystem shows them), and the first path is removed before the pod reads, so a
read from the recorded path would fail."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.data.prepare import preparation_key, prepare_from_config
from smelt_ds.data.token_sources import TokenFileChanged
from tests.data.data_test_utils import prose, write_jsonl
from tests.data.token_test_utils import EOT, packed, random_documents, read_split, word_tokenizer, write_megatron


def _mount_again(src: Path, dst: Path) -> None:
    """Every file of ``src`` at the same relative path under ``dst`` as a hard link."""
    for p in src.rglob("*"):
        if p.is_file():
            (dst / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, dst / p.relative_to(src))


@pytest.fixture
def tok(tmp_path) -> Path:
    for d in ("tokenizers", "pile", "web"):
        (tmp_path / "volume" / d).mkdir(parents=True)
    return word_tokenizer(tmp_path / "volume" / "tokenizers" / "tokenizer.json", 1000)


def _cfg(root: Path, cache: Path, sources: list[dict]) -> DataConfig:
    return DataConfig(sources=sources, tokenizer={"path": str(root / "tokenizers" / "tokenizer.json")},
                      validation_share=0.1, cache_dir=str(cache))


def test_a_megatron_dataset_prepared_on_the_login_node_is_read_in_the_pod(tmp_path, tok):
    login, pod, cache = tmp_path / "volume", tmp_path / "pod" / "corpora", tmp_path / "cache"
    docs = random_documents(120, 1000, seed=7)
    write_megatron(login / "pile" / "pile_text_document", docs, np.uint16)
    first = prepare_from_config(_cfg(login, cache, [{"megatron": str(login / "pile" / "pile_text_document")}]))
    assert first.created
    _mount_again(login, pod)
    shutil.rmtree(login)  # the login node's path does not exist in the pod

    cfg = _cfg(pod, cache, [{"megatron": str(pod / "pile" / "pile_text_document")}])
    again = prepare_from_config(cfg)
    assert not again.created and again.root == first.root  # reused, not prepared again
    (f,) = again.meta["token_files"]
    assert f["path"] == str((pod / "pile" / "pile_text_document.bin").resolve())
    assert f["index"]["path"] == str((pod / "pile" / "pile_text_document.idx").resolve())
    stream = np.concatenate([read_split(again, "train"), read_split(again, "validation")])
    assert sorted(map(tuple, np.split(stream, np.flatnonzero(stream == EOT)[:-1] + 1))) == \
        sorted(tuple(d) for d in packed(docs))  # every document, read from the pod's files


def test_a_text_corpus_prepared_elsewhere_is_reused_and_a_changed_file_is_not(tmp_path, tok):
    login, pod, cache = tmp_path / "volume", tmp_path / "pod" / "corpora", tmp_path / "cache"
    write_jsonl(login / "web" / "part-0.jsonl", prose(80, seed=3))
    first = prepare_from_config(_cfg(login, cache, [{"path": str(login / "web"), "domain": "web"}]))
    _mount_again(login, pod)
    cfg = _cfg(pod, cache, [{"path": str(pod / "web"), "domain": "web"}])
    assert preparation_key(cfg) == first.key
    assert not prepare_from_config(cfg).created
    # the same file changed in place, with its size kept: a new key (its modification time)
    path = pod / "web" / "part-0.jsonl"
    text = path.read_bytes()
    path.write_bytes(text.replace(b"a", b"b", 1))
    assert len(path.read_bytes()) == len(text) and preparation_key(cfg) != first.key
    assert prepare_from_config(cfg).created


def test_files_named_differently_do_not_take_another_sources_preparation(tmp_path, tok):
    """A pod whose source finds other file names (another dataset) does not relocate to them:
    the recorded path is kept, and verification names the missing file."""
    login, cache = tmp_path / "volume", tmp_path / "cache"
    docs = random_documents(60, 1000, seed=8)
    write_megatron(login / "pile" / "pile_text_document", docs, np.uint16)
    prepared = prepare_from_config(_cfg(login, cache, [{"megatron": str(login / "pile" / "pile_text_document")}]))
    other = tmp_path / "other"
    other.mkdir()
    for suffix in (".bin", ".idx"):
        os.link(login / "pile" / f"pile_text_document{suffix}", other / f"renamed{suffix}")
    (login / "pile" / "pile_text_document.bin").unlink()
    from smelt_ds.config.data import SourceConfig
    from smelt_ds.data.prepared import PreparedData

    with pytest.raises(TokenFileChanged, match=r"pile_text_document.bin.*is missing"):
        PreparedData.load(prepared.root, sources=[SourceConfig(megatron=str(other / "renamed"))])
