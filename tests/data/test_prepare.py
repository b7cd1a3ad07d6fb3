"""Preparation on real corpora: counts, end-of-text, split, dtype, caching, guards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from smelt_ds.data import DataConfig, PreparedData, prepare_from_config, token_dtype
from smelt_ds.errors import ConfigError
from smelt_ds.testing import scaled_timeout

from data_test_utils import (assign_documents, builtin_documents, encode_documents, prose, shakespeare_documents,
                             split_at_eot, two_domain_config, wiki_documents, write_jsonl)


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

    def drops_one(batch, tokenizer, eot_id):
        out = real(batch, tokenizer, eot_id)
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

    def no_separator_for_the_first(batch, tokenizer, eot_id):
        out = real(batch, tokenizer, eot_id)
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


def test_num_proc_2_with_tokenizers_parallelism_true_finishes(tmp_path):
    """A tokenizer whose thread pool already ran in the parent, then forked map workers: must not hang."""
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from smelt_ds.data import DataConfig, prepare_from_config
        from smelt_ds.data.tokenizer import train_tokenizer
        from smelt_ds.data.config import TokenizerConfig
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
