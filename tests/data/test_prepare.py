"""Preparation on real corpora: counts, end-of-text, split, dtype, caching, guards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.data.prepare import PreparedData, prepare_from_config, token_dtype
from smelt_ds.errors import ConfigError
from smelt_ds.testing import scaled_timeout
from tests.data.data_test_utils import (
    assign_documents,
    builtin_documents,
    encode_documents,
    prose,
    shakespeare_documents,
    split_at_eot,
    two_domain_config,
    wiki_documents,
    write_jsonl,
)


def _stream(prepared: PreparedData, split: str, source: int) -> np.ndarray:
    shards = prepared.shards(split, source=source)
    return np.concatenate([np.asarray(prepared.tokens(s)) for s in shards]) if shards else np.empty(0, np.int64)


def _check_source(prepared: PreparedData, source: int, docs: list[str]) -> list[bool]:
    """Shards of ``source`` = its documents re-tokenised directly, each + one end-of-text, split by document."""
    expected = encode_documents(prepared.root / "tokenizer.json", docs, prepared.eot_id)
    train = split_at_eot(_stream(prepared, "train", source), prepared.eot_id)
    valid = split_at_eot(_stream(prepared, "validation", source), prepared.eot_id)
    for doc in expected:
        assert doc.count(prepared.eot_id) == 1  # exactly one end-of-text per document
    return assign_documents(expected, train, valid)


# --------------------------------------------------------------------------------------------
# the built-in corpus (the default recipe's data)
# --------------------------------------------------------------------------------------------


def test_builtin_prepared_matches_direct_tokenisation(builtin_prepared, session_cache):
    p = builtin_prepared
    assert p.dtype == np.uint16 and p.vocab_size == 512 and p.eot_id == 0 and p.pad_id == 1
    for index, domain in enumerate(["code", "text"]):
        docs = builtin_documents(session_cache, domain)
        mask = _check_source(p, index, docs)
        assert sum(mask) == max(1, round(0.05 * len(docs)))
        splits = p.meta["splits"]
        assert splits["train"][domain]["documents"] + splits["validation"][domain]["documents"] == len(docs)
        assert splits["validation"][domain]["documents"] == sum(mask)
        assert p.shards("validation", domain=domain), "every domain has its own validation set"


def test_builtin_token_counts_in_metadata(builtin_prepared):
    p = builtin_prepared
    for shard in p.meta["shards"]:
        tokens = np.asarray(p.tokens(shard))
        assert shard["tokens"] == tokens.size and shard["bytes"] == tokens.nbytes
        assert shard["documents"] == int((tokens == p.eot_id).sum())
        assert shard["max_token_id"] == int(tokens.max())
    for s in p.meta["sources"]:
        mine = [sh for sh in p.meta["shards"] if sh["source"] == s["index"]]
        assert s["train_tokens"] + s["validation_tokens"] == sum(sh["tokens"] for sh in mine)


def test_second_run_reuses_prepared_output(builtin_prepared, session_cache, monkeypatch):
    import smelt_ds.data.prepare as prep

    monkeypatch.setattr(prep, "tokenise", lambda *a, **k: pytest.fail("a cached preparation tokenised again"))
    again = prepare_from_config(DataConfig(tokenizer={"vocab_size": 512}), session_cache)
    assert again.created is False and again.root == builtin_prepared.root and again.key == builtin_prepared.key


# --------------------------------------------------------------------------------------------
# real text: WikiText-2 and Tiny Shakespeare as two domains
# --------------------------------------------------------------------------------------------

def test_two_domains_counts_and_split(two_domains):
    p = two_domains
    assert p.domains == ["wiki", "shakespeare"]
    for index, (domain, docs) in enumerate([("wiki", wiki_documents()), ("shakespeare", shakespeare_documents())]):
        mask = _check_source(p, index, docs)
        assert sum(mask) == round(0.1 * len(docs))
        assert p.meta["splits"]["validation"][domain]["documents"] == sum(mask)
        assert p.meta["splits"]["train"][domain]["documents"] == len(docs) - sum(mask)
        assert [s["domain"] for s in p.shards("validation", domain=domain)] == [domain]
    skipped = p.meta["sources"][0]["skipped"]
    assert skipped["empty_document"] > 0  # wikitext's blank " " lines are counted, not hidden


def test_split_is_deterministic_and_seeded(two_domains, tmp_path):
    same = prepare_from_config(two_domain_config(tmp_path / "a"))
    assert [s["sha256"] for s in same.meta["shards"]] == [s["sha256"] for s in two_domains.meta["shards"]]
    other = prepare_from_config(two_domain_config(tmp_path / "b", seed=7))
    assert other.meta["shards"][0]["sha256"] != two_domains.meta["shards"][0]["sha256"]
    assert other.tokenizer_hash == two_domains.tokenizer_hash  # the tokenizer does not depend on the split


def test_uint32_chosen_for_a_large_vocabulary(tmp_path, two_domains):
    tok = two_domains.tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(70_000)])
    big = tmp_path / "big.json"
    tok.save(str(big))
    docs = shakespeare_documents()[:200]
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "s.jsonl", docs)), "domain": "s"}],
                     tokenizer={"path": str(big)}, cache_dir=str(tmp_path / "c"))
    p = prepare_from_config(cfg)
    assert p.vocab_size > 65536 and p.dtype == np.uint32
    assert p.shards("train")[0]["bytes"] == 4 * p.shards("train")[0]["tokens"]
    _check_source(p, 0, docs)


def test_token_dtype_boundary():
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32
    assert token_dtype(512) == np.uint16


# --------------------------------------------------------------------------------------------
# guards
# --------------------------------------------------------------------------------------------


def test_literal_end_of_text_in_a_document_is_plain_text(tmp_path):
    docs = prose(60)
    docs[3] = "a document that mentions <|endoftext|> in the middle " + docs[3]
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", docs))}],
                     tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    p = prepare_from_config(cfg)
    counted = sum(int((np.asarray(p.tokens(s)) == p.eot_id).sum()) for s in p.meta["shards"])
    assert counted == len(docs)
    _check_source(p, 0, docs)


def test_map_returning_fewer_rows_is_an_error(tmp_path, monkeypatch):
    import smelt_ds.data.prepare as prep

    real = prep._encode_batch

    def drops_one(batch, *args, **kwargs):
        out = real(batch, *args, **kwargs)
        return {"input_ids": out["input_ids"][:-1]}

    monkeypatch.setattr(prep, "_encode_batch", drops_one)
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(40)))}],
                     tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"returned 39 rows for 40 documents"):
        prepare_from_config(cfg)
    left = [p.name for p in (tmp_path / "c" / "prepared").iterdir() if not p.name.endswith(".failed")]
    assert left == [], "neither a prepared nor a temporary directory may be left"


def test_missing_end_of_text_is_caught_while_writing(tmp_path, monkeypatch):
    import smelt_ds.data.prepare as prep

    real = prep._encode_batch

    def no_separator_for_the_first(batch, *args, **kwargs):
        out = real(batch, *args, **kwargs)
        out["input_ids"][0] = out["input_ids"][0][:-1]
        return out

    monkeypatch.setattr(prep, "_encode_batch", no_separator_for_the_first)
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(40)))}],
                     tokenizer={"vocab_size": 300}, validation_share=0.0, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"39 end-of-text ids for 40 documents \(train\)"):
        prepare_from_config(cfg)


def test_changed_source_is_prepared_again(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", prose(40))
    cfg = DataConfig(sources=[{"path": str(path)}], tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    first = prepare_from_config(cfg)
    write_jsonl(path, prose(41))
    second = prepare_from_config(cfg)
    assert second.created and second.key != first.key
    assert second.meta["sources"][0]["documents"] == 41


@pytest.mark.slow
def test_num_proc_2_with_tokenizers_parallelism_true_finishes(tmp_path):
    """A tokenizer whose thread pool already ran in the parent, then forked map workers: must not hang."""
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from smelt_ds.config.data import DataConfig
        from smelt_ds.data.prepare import prepare_from_config
        from smelt_ds.data.tokenizer import train_tokenizer
        from smelt_ds.config.data import TokenizerConfig
        docs = [json.loads(l)["text"] for l in open({str(tmp_path / 'd.jsonl')!r})]
        tok = train_tokenizer([docs], TokenizerConfig(vocab_size=300))   # uses the thread pool here
        tok.encode_batch(docs)                                            # and again
        tok.save({str(tmp_path / 'tok.json')!r})
        cfg = DataConfig(sources=[{{"path": {str(tmp_path / 'd.jsonl')!r}}}], num_proc=2,
                         tokenizer={{"path": {str(tmp_path / 'tok.json')!r}}}, cache_dir={str(tmp_path / 'c')!r})
        p = prepare_from_config(cfg)
        print(json.dumps({{"root": str(p.root), "eot": p.eot_id}}))
    """)
    write_jsonl(tmp_path / "d.jsonl", prose(1000))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=scaled_timeout(120))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    p = PreparedData.load(out["root"])
    _check_source(p, 0, prose(1000))


# --------------------------------------------------------------------------------------------
# issue 13: the split does not depend on how a path is written (A), ids are never wrapped (B),
# long documents are tokenised in bounded pieces (E)
# --------------------------------------------------------------------------------------------


def test_split_does_not_depend_on_how_or_where_the_path_is_written(tmp_path, monkeypatch):
    import shutil

    docs = prose(200, seed=1)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    original = write_jsonl(tmp_path / "a" / "d.jsonl", docs)
    moved = tmp_path / "b" / "moved.jsonl"
    shutil.copyfile(original, moved)
    monkeypatch.chdir(tmp_path)

    def split(path: str):
        p = prepare_from_config(DataConfig(sources=[{"path": path, "domain": "d"}], tokenizer={"vocab_size": 300},
                                           cache_dir=str(tmp_path / "c")))
        return [s["sha256"] for s in p.shards("validation")], p.meta["splits"]["validation"]["d"]

    absolute = split(str(original))
    assert absolute[1]["documents"] == 10
    assert split("a/d.jsonl") == absolute            # relative
    assert split("./a/../a/d.jsonl") == absolute     # another spelling
    assert split(str(moved)) == absolute             # the same content elsewhere, under another name


def test_split_follows_the_documents_not_their_positions(tmp_path):
    """The held-out documents are chosen by their text: reordering a file keeps the same ones held out."""
    docs = prose(120, seed=2)

    def cfg(name: str, d: list[str]) -> DataConfig:
        return DataConfig(sources=[{"path": str(write_jsonl(tmp_path / name, d)), "domain": "d"}],
                          tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))

    def held(p: PreparedData, d: list[str]) -> list[str]:
        return sorted(doc for doc, v in zip(d, _check_source(p, 0, d), strict=True) if v)

    forward = prepare_from_config(cfg("f.jsonl", docs))
    backward = prepare_from_config(cfg("r.jsonl", docs[::-1]))
    assert held(forward, docs) == held(backward, docs[::-1])
    assert len(held(forward, docs)) == 6
    other_seed = prepare_from_config(cfg("f.jsonl", docs).model_copy(update={"seed": 99}))
    assert held(other_seed, docs) != held(forward, docs)


def test_builtin_split_is_unchanged(builtin_prepared, session_cache):
    """The built-in corpus keeps its split (drawn by (seed, crc32(name))): README numbers were measured on it."""
    import zlib

    for index, domain in enumerate(["code", "text"]):
        docs = builtin_documents(session_cache, domain)
        mask = _check_source(builtin_prepared, index, docs)
        n_val = max(1, round(0.05 * len(docs)))
        rng = np.random.default_rng(np.random.SeedSequence([1234, zlib.crc32(f"builtin={domain}|{domain}".encode())]))
        expected = np.zeros(len(docs), dtype=bool)
        expected[rng.choice(len(docs), size=n_val, replace=False)] = True
        assert mask == expected.tolist()


def test_ids_above_uint16_are_never_wrapped(tmp_path):
    """A tokenizer whose vocabulary is small but sparse (an id of 70,000): uint32, the id kept as is."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|pad|>": 1, "a": 2, "b": 70_000}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "sparse.json"))
    docs = ["a b a", "b b", "a a"] * 10
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", docs))}], validation_share=0.0,
                     tokenizer={"path": str(tmp_path / "sparse.json")}, cache_dir=str(tmp_path / "c"))
    p = prepare_from_config(cfg)
    stream = _stream(p, "train", 0)
    assert p.vocab_size == 4 and p.dtype == np.uint32
    assert stream.tolist() == [2, 70_000, 2, 0, 70_000, 70_000, 0, 2, 2, 0] * 10
    assert p.shards("train")[0]["max_token_id"] == 70_000


def test_shard_writer_refuses_an_id_its_dtype_cannot_hold(tmp_path):
    from smelt_ds.data.prepare import _ShardWriter

    w = _ShardWriter(tmp_path, "train", "d", 0, 3, np.dtype(np.uint16), 100, 0)
    with pytest.raises(ConfigError, match=r"token id 70000 does not fit uint16"):
        w.write(np.array([5, 70_000, 0], dtype=np.int64))


ONE_LINE_MB = 3


def _one_line_text(n_bytes: int) -> str:
    text = " ".join(p.replace("\n", " ") for p in prose(3000))
    return (text * (n_bytes // len(text) + 1))[:n_bytes]


@pytest.mark.slow
def test_a_long_single_line_document_is_tokenised_in_bounded_memory(tmp_path):
    """A 3 MB single-line document with a 64 KB limit: preparing it takes about 130 MB more than the
    interpreter already holds (about 750 MB when the whole document goes to the tokenizer at once)."""
    (tmp_path / "one.txt").write_text(_one_line_text(ONE_LINE_MB * 1_000_000))
    script = textwrap.dedent(f"""
        import json, resource
        import smelt_ds.data.prepare as prep
        from smelt_ds.config.data import DataConfig
        cfg = DataConfig(sources=[{{"path": {str(tmp_path / 'one.txt')!r}, "sample_by": "line"}}],
                         validation_share=0.0, tokenizer={{"vocab_size": 300}}, tokenize_chunk_bytes=65536,
                         cache_dir={str(tmp_path / 'c')!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        p = prep.prepare_from_config(cfg)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"delta_mb": (after - before) / 1024, "tokens": p.meta["splits"]["train"]["one"]["tokens"]}}))
    """)
    env = {**os.environ, "RAYON_NUM_THREADS": "2"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=scaled_timeout(300))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["tokens"] > 100_000
    assert out["delta_mb"] < 250, out  # about 750 MB when the whole document goes to the tokenizer at once


def test_cut_documents_give_the_ids_of_whole_documents(tmp_path):
    """Cutting long documents at whitespace (limit 8 KB) changes neither the tokenizer nor the shards."""
    docs = prose(60) + [_one_line_text(300_000), "\n".join(prose(400, seed=3))]
    path = write_jsonl(tmp_path / "d.jsonl", docs)

    def prepare(limit: int, name: str):
        return prepare_from_config(DataConfig(sources=[{"path": str(path), "domain": "d"}], tokenize_chunk_bytes=limit,
                                              tokenizer={"vocab_size": 400}, cache_dir=str(tmp_path / name)))

    cut, whole = prepare(8192, "cut"), prepare(10_000_000, "whole")
    assert cut.tokenizer_hash == whole.tokenizer_hash
    assert [s["sha256"] for s in cut.meta["shards"]] == [s["sha256"] for s in whole.meta["shards"]]
    _check_source(cut, 0, docs)


def test_a_long_stretch_without_whitespace_is_refused(tmp_path):
    docs = prose(30) + ["x" * 20_000]
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", docs))}], tokenize_chunk_bytes=8192,
                     tokenizer={"vocab_size": 300}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"data.sources\[0\] file '.*d.jsonl' line 31: a document of 20,000 UTF-8 "
                                          r"bytes has no whitespace.*data.tokenize_chunk_bytes \(8192\)"):
        prepare_from_config(cfg)


def test_long_documents_with_a_tokenizer_that_cannot_be_cut_exactly(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|pad|>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "wl.json"))
    docs = prose(30) + [_one_line_text(20_000)]
    size = len(docs[-1].encode("utf-8"))
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", docs))}], tokenize_chunk_bytes=8192,
                     tokenizer={"path": str(tmp_path / "wl.json")}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=rf"data.sources\[0\] .* document 31 \(in source order\): {size:,} UTF-8 "
                                          r"bytes, .*cannot be cut exactly: it has a normalizer \(Lowercase\)"):
        prepare_from_config(cfg)
    ok = prepare_from_config(cfg.model_copy(update={"tokenize_chunk_bytes": size}))
    assert ok.meta["sources"][0]["documents"] == 31


_OPEN_PREPARED = """
import json, sys
from smelt_ds.config.data import DataConfig
from smelt_ds.data.prepare import prepare_from_config
import smelt_ds.train.loop  # noqa: F401 (what a training rank imports)
prepared = prepare_from_config(DataConfig(tokenizer={"vocab_size": 512}), sys.argv[1])
print(json.dumps({"root": str(prepared.root), "imported": [m for m in ("datasets", "pandas") if m in sys.modules]}))
"""


@pytest.mark.slow
def test_a_rank_that_opens_a_finished_preparation_does_not_import_datasets(builtin_prepared, session_cache):
    """`datasets` (with pandas, about 0.6 s per process on 2 cores) is imported only to prepare:
    the training loop's modules and opening the preparation the session made do not need it."""
    out = subprocess.run([sys.executable, "-c", _OPEN_PREPARED, str(session_cache)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"root": str(builtin_prepared.root), "imported": []}
