"""Byte-level BPE: deterministic training, special tokens, round trip, caching, CLI."""

from __future__ import annotations

import json

import pytest

from smelt_ds.cli import main
from smelt_ds.config.data import DataConfig, TokenizerConfig
from smelt_ds.data.prepare import build_tokenizer
from smelt_ds.data.tokenizer import train_tokenizer
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import load_tokenizer, tokenizer_hash
from tests.data.data_test_utils import prose, write_jsonl


def test_training_is_deterministic_with_specials_first():
    docs = prose(400)
    a = train_tokenizer([docs[:200], docs[200:]], TokenizerConfig(vocab_size=600))
    b = train_tokenizer([docs[:200], docs[200:]], TokenizerConfig(vocab_size=600))
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert a.get_vocab_size() == 600
    assert a.token_to_id("<|endoftext|>") == 0 and a.token_to_id("<|pad|>") == 1
    c = train_tokenizer([docs], TokenizerConfig(vocab_size=601))
    assert tokenizer_hash(c) != tokenizer_hash(a)


def test_byte_level_round_trip_of_any_text():
    tok = train_tokenizer([prose(100)], TokenizerConfig(vocab_size=300))
    text = "Grüße, 東京 🚀 tabs\tand\x00nul — def f(x):\n    return x ** 2\n"
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert None not in enc.ids and max(enc.ids) < 300


def test_cached_by_inputs_and_settings(tmp_path, monkeypatch):
    import smelt_ds.data.tokenizer as tk

    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(100)))}],
                     tokenizer={"vocab_size": 320}, cache_dir=str(tmp_path / "c"))
    path, trained = build_tokenizer(cfg)
    assert trained and load_tokenizer(path).get_vocab_size() == 320
    monkeypatch.setattr(tk, "train_tokenizer", lambda *a, **k: pytest.fail("retrained a cached tokenizer"))
    again, trained_again = build_tokenizer(cfg)
    assert (again, trained_again) == (path, False)
    monkeypatch.undo()
    other, trained_other = build_tokenizer(cfg.model_copy(update={"tokenizer": TokenizerConfig(vocab_size=330)}))
    assert trained_other and other != path and load_tokenizer(other).get_vocab_size() == 330


def test_cli_trains_then_reuses(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", prose(120))
    argv = ["data", "tokenizer", "--input", str(data), "--vocab-size", "300", "-o", str(tmp_path / "tok.json"),
            "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 0
    first = capsys.readouterr().out
    digest = tokenizer_hash(load_tokenizer(tmp_path / "tok.json"))
    assert "tokenizer trained" in first and digest in first
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "reused from cache" in second and digest in second


def test_tokenizer_without_the_end_of_text_token(tmp_path):
    from smelt_ds.data.prepare import prepare_from_config

    tok = train_tokenizer([prose(100)], TokenizerConfig(vocab_size=300, eot_token="<eos>", pad_token="<pad>"))
    tok.save(str(tmp_path / "t.json"))
    cfg = DataConfig(sources=[{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(30)))}],
                     tokenizer={"path": str(tmp_path / "t.json")}, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"`data.tokenizer.eot_token` \('<\|endoftext\|>'\) is not in the tokenizer"):
        prepare_from_config(cfg)
    ok = prepare_from_config(cfg.model_copy(update={"tokenizer": TokenizerConfig(
        path=str(tmp_path / "t.json"), eot_token="<eos>", pad_token="<pad>")}))
    meta = json.loads((ok.root / "meta.json").read_text())
    assert ok.eot_id == tok.token_to_id("<eos>") == meta["tokenizer"]["eot_id"]


def test_training_text_cap_counts_utf8_bytes():
    from smelt_ds.data.tokenizer import capped_batches

    batches = [["aé", "bb"], ["cc", "dd"]]  # 3, 2, 2, 2 bytes
    assert list(capped_batches(batches, 7)) == [["aé", "bb"], ["cc"]]
    assert list(capped_batches(batches, 4)) == [["aé"]]
    assert list(capped_batches(batches, None)) == batches


def test_a_vocabulary_the_corpus_cannot_fill_is_an_error(tmp_path, capsys):
    """--vocab-size 100000 on a small corpus: say how many tokens it supports, write nothing."""
    import re

    from smelt_ds.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", prose(30))
    argv = ["data", "tokenizer", "--input", str(data), "--vocab-size", "100000", "-o", str(tmp_path / "tok.json"),
            "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "`data.tokenizer.vocab_size` (100000)" in err and "min_frequency=2" in err, err
    supported = int(re.search(r"supports only ([\d,]+) tokens", err).group(1).replace(",", ""))
    assert 258 < supported < 100_000
    assert train_tokenizer([prose(30)], TokenizerConfig(vocab_size=supported)).get_vocab_size() == supported
    assert f"vocab_size={supported}" in err  # the fix names the size that works
    assert not (tmp_path / "tok.json").exists() and not list((tmp_path / "c" / "tokenizers").glob("*/tokenizer.json"))
    with pytest.raises(ConfigError, match=rf"supports only {supported:,} tokens"):
        train_tokenizer([prose(30)], TokenizerConfig(vocab_size=supported + 1))
