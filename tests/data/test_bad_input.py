"""Bad input: a clear ConfigError naming file/field, line and fix, or a counted and reported skip."""

from __future__ import annotations

import json
import shutil
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from smelt_ds.config.data import DataConfig
from smelt_ds.data.loader import TrainLoader
from smelt_ds.data.prepare import PreparedData, prepare_from_config
from smelt_ds.errors import ConfigError
from tests.data.data_test_utils import encode_documents, prose, split_at_eot, write_jsonl


def config(tmp_path, sources, **extra) -> DataConfig:
    extra.setdefault("tokenizer", {"vocab_size": 300})
    return DataConfig(sources=sources, cache_dir=str(tmp_path / "cache"), **extra)


def all_documents(prepared: PreparedData, source: int = 0) -> list[list[int]]:
    docs = []
    for split in ("train", "validation"):
        for shard in prepared.shards(split, source=source):
            docs += split_at_eot(prepared.tokens(shard), prepared.eot_id)
    return docs


# --------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    cfg = config(tmp_path, [{"path": str(tmp_path / "nope.txt")}])
    with pytest.raises(ConfigError, match=r"`data.sources\[0\].path` \('.*nope.txt'\): no such file"):
        prepare_from_config(cfg)


def test_empty_file_given_explicitly(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match=r"`data.sources\[0\].path` .*empty.txt.*is empty \(0 bytes\)"):
        prepare_from_config(config(tmp_path, [{"path": str(tmp_path / "empty.txt")}]))


def test_empty_file_in_a_directory_is_counted(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = prose(30)
    for i, d in enumerate(docs):
        (corpus / f"doc{i:02d}.txt").write_text(d)
    (corpus / "zz-empty.txt").write_text("")
    p = prepare_from_config(config(tmp_path, [{"path": str(corpus)}]))
    src = p.meta["sources"][0]
    assert src["skipped"]["empty_file"] == 1 and src["documents"] == 30 and src["files"] == 31
    assert "empty_file" in p.summary()
    assert sorted(all_documents(p)) == sorted(encode_documents(p.root / "tokenizer.json", docs, p.eot_id))


def test_directory_without_matching_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("text")
    with pytest.raises(ConfigError, match=r"no files matching glob '\*\*/\*.jsonl'"):
        prepare_from_config(config(tmp_path, [{"path": str(tmp_path / "d"), "glob": "**/*.jsonl"}]))


def test_corpus_too_small_for_one_window(tmp_path):
    p = prepare_from_config(config(tmp_path, [{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(20)))}],
                                   validation_share=0.0))
    tokens = p.meta["splits"]["train"]["d"]["tokens"]
    with pytest.raises(ConfigError, match=rf"{tokens} train tokens and no window of train.seq_len \+ 1 = "
                                          rf"{tokens + 1} tokens"):
        TrainLoader(p, tokens, 1, dp_rank=0, dp_world_size=1)
    TrainLoader(p, tokens - 1, 1, dp_rank=0, dp_world_size=1)  # exactly one window fits
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        TrainLoader(p, tokens - 1, 2, dp_rank=0, dp_world_size=1)


def test_source_with_one_document_cannot_be_split(tmp_path):
    (tmp_path / "one.txt").write_text(prose(1)[0])
    with pytest.raises(ConfigError, match=r"1 document\(s\) cannot be split .*validation_share=0.05"):
        prepare_from_config(config(tmp_path, [{"path": str(tmp_path / "one.txt")}]))


# --------------------------------------------------------------------------------------------
# encodings
# --------------------------------------------------------------------------------------------

BAD_UTF8 = (b"first line is fine\n"
            b"second line has a latin-1 caf\xe9 and a lone \xff byte\n"
            b"third has a genuine replacement char \xef\xbf\xbd and a cut sequence \xe2\x82\n")


def test_non_utf8_replaced_and_counted(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(BAD_UTF8 * 12)
    p = prepare_from_config(config(tmp_path, [{"path": str(path), "sample_by": "line"}], validation_share=0.0,
                                   max_invalid_utf8_share=0.05))  # 4 of 131 bytes (3.1%) are invalid
    src = p.meta["sources"][0]
    assert src["replaced_invalid_utf8"] == 3 * 12  # \xe9, \xff, \xe2\x82; the genuine U+FFFD is not counted
    assert src["skipped"]["empty_document"] == 1  # the empty string after the final newline
    expected_docs = [d for d in (BAD_UTF8 * 12).decode("utf-8", "replace").split("\n") if d.strip()]
    assert all_documents(p) == encode_documents(p.root / "tokenizer.json", expected_docs, p.eot_id)


def test_non_utf8_error_names_file_and_line(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(BAD_UTF8)
    with pytest.raises(ConfigError, match=r"latin.txt' line 2 .*invalid UTF-8 byte b'\\xe9'.*data.non_utf8=replace"):
        prepare_from_config(config(tmp_path, [{"path": str(path)}], non_utf8="error"))


def test_non_utf8_in_jsonl_error_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "fine too"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl' line 3 "):
        prepare_from_config(config(tmp_path, [{"path": str(path)}], non_utf8="error"))


# --------------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------------


def bad_jsonl(tmp_path):
    docs = prose(40)
    lines = [json.dumps({"text": d}) for d in docs]
    lines.insert(5, '{"text": "unterminated')            # line 6: not JSON
    lines.insert(9, json.dumps({"body": "no text key"}))  # line 10: lacks the field
    lines.insert(12, "")                                  # line 13: blank
    lines.insert(20, json.dumps(["a", "list"]))           # line 21: not an object
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, docs


def test_bad_jsonl_line_error_names_file_and_line(tmp_path):
    path, _ = bad_jsonl(tmp_path)
    with pytest.raises(ConfigError, match=r"bad.jsonl' line 6: not valid JSON .*data.bad_jsonl_lines=skip"):
        prepare_from_config(config(tmp_path, [{"path": str(path)}]))


def test_jsonl_line_without_text_field_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", prose(5))
    with open(path, "a") as f:
        f.write(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"d.jsonl' line 6: JSON dict without a string field 'text'"):
        prepare_from_config(config(tmp_path, [{"path": str(path)}]))


def test_bad_jsonl_lines_skipped_and_counted(tmp_path):
    path, docs = bad_jsonl(tmp_path)
    p = prepare_from_config(config(tmp_path, [{"path": str(path)}], bad_jsonl_lines="skip"))
    src = p.meta["sources"][0]
    assert src["skipped"]["bad_jsonl_line"] == 3 and src["skipped"]["blank_line"] == 1
    assert src["documents"] == len(docs)
    assert sorted(all_documents(p)) == sorted(encode_documents(p.root / "tokenizer.json", docs, p.eot_id))


# --------------------------------------------------------------------------------------------
# Parquet and dataset sources
# --------------------------------------------------------------------------------------------


def test_parquet_source_with_text_field(tmp_path):
    docs = prose(50)
    pq.write_table(pa.table({"id": list(range(50)), "body": docs}), tmp_path / "d.parquet")
    p = prepare_from_config(config(tmp_path, [{"path": str(tmp_path / "d.parquet"), "text_field": "body"}]))
    assert sorted(all_documents(p)) == sorted(encode_documents(p.root / "tokenizer.json", docs, p.eot_id))
    with pytest.raises(ConfigError, match=r"no column 'text' \(columns: \['id', 'body'\]\)"):
        prepare_from_config(config(tmp_path, [{"path": str(tmp_path / "d.parquet")}]))


def test_local_dataset_directory_through_load_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    docs = prose(50, seed=3)
    (tmp_path / "ds").mkdir()
    pq.write_table(pa.table({"text": docs}), tmp_path / "ds" / "train.parquet")
    p = prepare_from_config(config(tmp_path, [{"dataset": str(tmp_path / "ds"), "domain": "local"}], offline=True))
    assert p.meta["sources"][0]["documents"] == 50
    assert sorted(all_documents(p)) == sorted(encode_documents(p.root / "tokenizer.json", docs, p.eot_id))


@pytest.mark.parametrize("how", ["flag", "env"])
def test_uncached_dataset_name_offline_fails_fast(tmp_path, monkeypatch, how):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    if how == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config(tmp_path, [{"dataset": "smelt-ds-test/definitely-not-cached"}], offline=(how == "flag"))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"`data.sources\[0\].dataset` \('smelt-ds-test/definitely-not-cached'\): "
                                          r"not found in the local datasets cache .* offline mode is on"):
        prepare_from_config(cfg)
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------------------------
# damaged outputs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prepared_copy(tmp_path):
    p = prepare_from_config(config(tmp_path, [{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(60)))}]))
    copy = tmp_path / "copy"
    shutil.copytree(p.root, copy)
    return copy, p.meta["shards"][0]


def test_truncated_shard_detected(prepared_copy):
    root, shard = prepared_copy
    path = root / shard["file"]
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=rf"has {shard['bytes'] - 2} bytes, meta.json says {shard['bytes']}"):
        PreparedData.load(root, verify="size")


def test_modified_shard_detected(prepared_copy):
    root, shard = prepared_copy
    path = root / shard["file"]
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    PreparedData.load(root, verify="size")  # same size: only the checksum can tell
    with pytest.raises(ConfigError, match=r"sha256 [0-9a-f]{12} does not match meta.json"):
        PreparedData.load(root)


def test_incomplete_directory_is_never_used(prepared_copy):
    root, _ = prepared_copy
    (root / "_COMPLETE").unlink()
    with pytest.raises(ConfigError, match="missing or incomplete"):
        PreparedData.load(root)


def test_damaged_cache_entry_is_not_reused_silently(tmp_path):
    cfg = config(tmp_path, [{"path": str(write_jsonl(tmp_path / "d.jsonl", prose(60)))}])
    p = prepare_from_config(cfg)
    shard = p.root / p.meta["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ConfigError, match="truncated"):
        prepare_from_config(cfg)


def test_output_dir_holding_other_data(tmp_path):
    out = tmp_path / "out"
    a = write_jsonl(tmp_path / "a.jsonl", prose(30))
    b = write_jsonl(tmp_path / "b.jsonl", prose(30, seed=5))
    prepare_from_config(config(tmp_path, [{"path": str(a)}], output_dir=str(out)))
    with pytest.raises(ConfigError, match=r"`data.output_dir` .* holds data prepared from other sources"):
        prepare_from_config(config(tmp_path, [{"path": str(b)}], output_dir=str(out)))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user file")
    with pytest.raises(ConfigError, match="exists and is not a complete smelt-ds output"):
        prepare_from_config(config(tmp_path, [{"path": str(a)}], output_dir=str(tmp_path / "mine")))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "user file"


def test_shards_split_at_shard_max_tokens(tmp_path):
    docs = prose(80)
    p = prepare_from_config(config(tmp_path, [{"path": str(write_jsonl(tmp_path / "d.jsonl", docs))}],
                                   shard_max_tokens=1000, validation_share=0.0))
    shards = p.shards("train")
    assert len(shards) > 2 and all(s["tokens"] == 1000 for s in shards[:-1]) and shards[-1]["tokens"] <= 1000
    stream = np.concatenate([np.asarray(p.tokens(s)) for s in shards])
    assert split_at_eot(stream, p.eot_id) == encode_documents(p.root / "tokenizer.json", docs, p.eot_id)


# --------------------------------------------------------------------------------------------
# issue 13: binary files (D), missing shards and leftovers of killed runs (F)
# --------------------------------------------------------------------------------------------


def _bad_bytes(raw: bytes) -> int:
    return len(raw) - len(raw.decode("utf-8", "ignore").encode("utf-8"))


def test_binary_file_is_refused_naming_file_and_share(tmp_path):
    rng = np.random.default_rng(0)
    blob = b"\x7fELF\x02\x01\x01\x00" + rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    path = tmp_path / "libfoo.so"
    path.write_bytes(blob)
    bad, nul = _bad_bytes(blob), blob.count(b"\x00")
    with pytest.raises(ConfigError) as info:
        prepare_from_config(config(tmp_path, [{"path": str(path), "sample_by": "line"}]))
    msg = str(info.value)
    assert "libfoo.so" in msg and f"{nul:,} NUL byte" in msg, msg
    assert f"{bad:,} of {len(blob):,} bytes ({100 * bad / len(blob):.1f}%) are not valid UTF-8" in msg, msg


def test_mostly_invalid_utf8_without_nul_is_refused(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, d in enumerate(prose(20)):
        (corpus / f"doc{i:02d}.txt").write_text(d)
    greek = "Καλημέρα κόσμε, αυτό είναι ελληνικό κείμενο.\n".encode("iso-8859-7") * 50  # not UTF-8
    (corpus / "zz-greek.txt").write_bytes(greek)
    bad = _bad_bytes(greek)
    with pytest.raises(ConfigError, match=rf"zz-greek.txt'.*{bad:,} of {len(greek):,} bytes .* not valid UTF-8.*"
                                          r"data.max_invalid_utf8_share \(0.01\).*iconv"):
        prepare_from_config(config(tmp_path, [{"path": str(corpus), "sample_by": "line"}]))
    p = prepare_from_config(config(tmp_path, [{"path": str(corpus), "sample_by": "line"}], max_invalid_utf8_share=0.9))
    assert p.meta["sources"][0]["replaced_invalid_utf8"] > 0


def test_nul_bytes_are_refused_even_in_valid_utf8(tmp_path):
    path = tmp_path / "utf16.txt"
    raw = "\n".join(prose(20)).encode("utf-16-le")  # about every other byte is NUL, all valid UTF-8
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=rf"utf16.txt': {raw.count(0):,} NUL byte\(s\) in {len(raw):,} bytes: "
                                          r"this is not text.*iconv -f utf-16"):
        prepare_from_config(config(tmp_path, [{"path": str(path), "sample_by": "line"}], non_utf8="error"))


def test_verify_says_a_deleted_shard_is_missing(prepared_copy, capsys):
    from smelt_ds.cli import main

    root, shard = prepared_copy
    (root / shard["file"]).unlink()
    assert main(["data", "verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"shard {str(root / shard['file'])!r} is missing" in err and "None" not in err, err


def test_a_killed_prepare_leaves_nothing_behind_after_the_next_run(tmp_path):
    """A run killed (SIGKILL) while writing leaves its hidden temporary directory; the next run removes it."""
    import os
    import subprocess
    import sys
    import textwrap

    data = write_jsonl(tmp_path / "d.jsonl", prose(60))
    out = tmp_path / "prepared"
    cfg = config(tmp_path, [{"path": str(data)}], output_dir=str(out))
    script = textwrap.dedent(f"""
        import os, signal
        import smelt_ds.data.prepare as prep
        from smelt_ds.config.data import DataConfig
        def killed(tmp, *args):
            (tmp / "train").mkdir()
            (tmp / "train" / "partial.bin").write_bytes(b"0" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)
        prep._prepare_into = killed
        prep.prepare_from_config(DataConfig.model_validate_json({cfg.model_dump_json()!r}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == -9, res.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".prepared.tmp-")]
    assert len(left) == 1, "the killed run should have left its temporary directory"
    p = prepare_from_config(cfg)
    assert p.created and p.root == out
    assert [q.name for q in tmp_path.iterdir() if ".tmp-" in q.name] == []
    assert not os.path.exists(tmp_path / left[0])
