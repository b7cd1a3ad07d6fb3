"""Token sources (Megatron .bin/.idx, flat numpy token files): read back token-exactly against
files written by the formats' own writers, the content-based split, loader windows, resume,
the vocabulary check, mixing with text sources, transformers tokenizer directories, training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from smelt_ds.cli import main
from smelt_ds.config.data import DataConfig
from smelt_ds.data.loader import TrainLoader, ValidationLoader, check_compatible, windows_in
from smelt_ds.data.prepare import PreparedData, prepare_from_config
from smelt_ds.data.token_files import content_keys, select_smallest
from smelt_ds.errors import ConfigError
from smelt_ds.runs.tokenizer_file import load_tokenizer, tokenizer_hash
from smelt_ds.testing import scaled_timeout
from tests.data.data_test_utils import assign_documents, split_at_eot, write_jsonl
from tests.data.token_test_utils import (
    EOT,
    packed,
    random_documents,
    read_split,
    word_tokenizer,
    write_flat,
    write_megatron,
)

ROOT = Path(__file__).resolve().parents[2]
S, B = 16, 3


def _cfg(tmp: Path, sources: list[dict], tokenizer: Path, **extra) -> DataConfig:
    return DataConfig(sources=sources, tokenizer={"path": str(tokenizer)}, validation_share=0.1,
                      cache_dir=str(tmp / "cache"), **extra)


def _check_read_back(prepared: PreparedData, expected: list[list[int]], domain: str | None = None) -> list[bool]:
    """Every document comes back exactly once, in order, in train or validation; returns the mask."""
    train = split_at_eot(read_split(prepared, "train", domain), EOT)
    valid = split_at_eot(read_split(prepared, "validation", domain), EOT)
    mask = assign_documents(expected, train, valid)
    assert sum(mask) == max(1, round(0.1 * len(expected)))
    return mask


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 1000)


@pytest.fixture(scope="module")
def megatron_data(tmp_path_factory, small_tok):
    """200 documents in a uint16 Megatron dataset (written by megatron-core), prepared once
    with shards of at most 700 tokens (so windows meet shard ends)."""
    tmp = tmp_path_factory.mktemp("meg")
    docs = random_documents(200, 1000, seed=1)
    write_megatron(tmp / "web_text_document", docs, np.uint16)
    cfg = _cfg(tmp, [{"megatron": str(tmp / "web_text_document")}], small_tok, shard_max_tokens=700)
    return docs, prepare_from_config(cfg), tmp


# --------------------------------------------------------------------------------------------
# read back, token-exactly
# --------------------------------------------------------------------------------------------


def test_megatron_uint16_reads_back_every_document(megatron_data):
    docs, prepared, _ = megatron_data
    _check_read_back(prepared, packed(docs))
    (f,) = prepared.meta["token_files"]
    assert (f["format"], f["dtype"], f["documents"], f["empty_documents"]) == ("megatron", "uint16", 200, 1)
    assert f["max_token_id"] == max(int(d.max()) for d in docs)
    assert len(prepared.shards("train")) > 1 and all(s["tokens"] <= 700 for s in prepared.shards("train"))


def test_megatron_int32_with_ids_beyond_uint16(tmp_path):
    tok = word_tokenizer(tmp_path / "tok.json", 70_000)
    docs = random_documents(60, 70_000, seed=2)
    docs[0][0] = 69_999  # an id that uint16 cannot hold
    write_megatron(tmp_path / "big", docs, np.int32)
    prepared = prepare_from_config(_cfg(tmp_path, [{"megatron": str(tmp_path / "big.idx")}], tok))
    _check_read_back(prepared, packed(docs))
    assert prepared.meta["token_files"][0]["dtype"] == "int32"
    assert prepared.meta["token_files"][0]["max_token_id"] == 69_999


def test_flat_numpy_files_read_back_every_document(tmp_path, small_tok):
    """A directory of an np.save uint32 file and a raw (tofile) uint32 file with `.npy` name, as
    OLMo writes them: documents in file order, an empty document skipped, a last document
    without end-of-text gets one."""
    a, b = random_documents(40, 1000, seed=3), random_documents(30, 1000, seed=4)
    (tmp_path / "olmo").mkdir()
    write_flat(tmp_path / "olmo" / "part-0.npy", a, np.uint32, header=True)
    write_flat(tmp_path / "olmo" / "part-1.npy", b, np.uint32, header=False, tail=False)
    src = {"tokens": str(tmp_path / "olmo"), "glob": "*.npy", "token_dtype": "uint32", "eot_id": EOT}
    prepared = prepare_from_config(_cfg(tmp_path, [src], small_tok))
    _check_read_back(prepared, packed(a + b))
    files = prepared.meta["token_files"]
    assert [(f["format"], f["documents"], f["empty_documents"]) for f in files] == [("npy", 40, 1), ("raw", 30, 1)]
    assert prepared.domains == ["olmo"]


def test_packed_tokens_slices_equal_the_reference_stream(megatron_data):
    """Any slice of a virtual shard equals the same slice of the reference stream (documents of
    the split in order, each + end-of-text), also slices that start or end on an end-of-text."""
    docs, prepared, _ = megatron_data
    mask = _check_read_back(prepared, packed(docs))
    ref = np.array(sum((d for d, m in zip(packed(docs), mask, strict=True) if not m), []), dtype=np.int64)
    for shard in prepared.shards("train"):
        view, base = prepared.tokens(shard), shard["offset"]
        assert len(view) == shard["tokens"]
        for lo, hi in [(0, 1), (0, len(view)), (5, 37), (len(view) - 3, len(view) + 10)]:
            assert view[lo:hi].tolist() == ref[base + lo:base + min(hi, len(view))].tolist()
        assert int(view[-1]) == ref[base + len(view) - 1]


# --------------------------------------------------------------------------------------------
# the split follows the documents' content
# --------------------------------------------------------------------------------------------


def test_split_is_the_same_for_the_same_documents_anywhere(tmp_path, small_tok, megatron_data):
    """The same documents reversed, in a flat uint32 file under another name, hold out the same
    documents as the Megatron uint16 dataset; train and validation are disjoint."""
    docs, prepared, _ = megatron_data
    mask = _check_read_back(prepared, packed(docs))
    write_flat(tmp_path / "other.npy", docs[::-1], np.uint32, header=True)
    again = prepare_from_config(_cfg(tmp_path, [{"tokens": str(tmp_path / "other.npy"), "eot_id": EOT}], small_tok))
    mask_again = _check_read_back(again, packed(docs[::-1]))
    held = {tuple(d.tolist()) for d, m in zip(docs, mask, strict=True) if m}
    assert held == {tuple(d.tolist()) for d, m in zip(docs[::-1], mask_again, strict=True) if m}
    trained = {tuple(d.tolist()) for d, m in zip(docs, mask, strict=True) if not m}
    assert not held & trained


def test_document_keys_depend_on_content_not_place_or_dtype():
    docs = random_documents(50, 1000, seed=5, max_len=300)
    flat = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs])[:-1]])
    lengths = np.array([len(d) for d in docs])
    keys = content_keys(flat.astype(np.uint16), starts, lengths, seed=7)
    shifted = np.concatenate([np.full(13, 999), flat]).astype(np.uint32)
    assert np.array_equal(content_keys(shifted, starts + 13, lengths, seed=7), keys)
    assert len(set(keys.tolist())) == len(docs)  # distinct documents, distinct keys
    assert not np.array_equal(content_keys(flat, starts, lengths, seed=8), keys)  # keyed by the seed


@pytest.mark.parametrize("n", [1, 7, 500, 999, 1000])
def test_select_smallest_equals_stable_argsort(n):
    rng = np.random.default_rng(n)
    keys = rng.integers(0, 2**64, 1000, dtype=np.uint64, endpoint=False)
    keys[:600] >>= np.uint64(20)  # most keys in the histogram's first bucket (top 16 bits 0): the exact pass decides
    keys[rng.integers(0, 1000, 300)] = keys[0]  # many ties
    keys[:50] = keys[50:100]  # and pairs in another order
    t, ties = select_smallest(keys, n)
    mask = keys < np.uint64(t)
    mask[np.flatnonzero(keys == np.uint64(t))[:ties]] = True
    expected = np.zeros(1000, dtype=bool)
    expected[np.argsort(keys, kind="stable")[:n]] = True
    assert np.array_equal(mask, expected)


# --------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------


def _reference_windows(docs: list[np.ndarray], mask: list[bool], split: str, max_tokens: int, seq_len: int):
    """Windows of seq_len + 1 tokens, stride seq_len, in each max_tokens piece of the split's
    reference stream (its documents in order, each + end-of-text), in window-id order."""
    in_split = [d for d, m in zip(packed(docs), mask, strict=True) if m == (split == "validation")]
    ref = np.array(sum(in_split, []), dtype=np.int64)
    pieces = [ref[a:a + max_tokens] for a in range(0, len(ref), max_tokens)]
    return [p[j * seq_len:j * seq_len + seq_len + 1] for p in pieces for j in range(windows_in(len(p), seq_len))]


def test_train_and_validation_windows_equal_the_reference(megatron_data):
    docs, prepared, _ = megatron_data
    mask = _check_read_back(prepared, packed(docs))
    ref = _reference_windows(docs, mask, "train", 700, S)
    loader = TrainLoader(prepared, S, B, seed=3, dp_rank=0, dp_world_size=1)
    assert loader.num_windows == len(ref)
    for _ in range(loader.steps_per_epoch + 2):  # into the second epoch
        batch = next(loader)
        for row, sid in enumerate(batch["sample_ids"].tolist()):
            assert batch["input_ids"][row].tolist() == ref[sid][:-1].tolist()
            assert batch["labels"][row].tolist() == ref[sid][1:].tolist()
    val_ref = _reference_windows(docs, mask, "validation", 700, S)
    got = [w for b in ValidationLoader(prepared, "web_text_document", S, 2, dp_rank=0, dp_world_size=1)
           for w in np.concatenate([b["input_ids"], b["labels"][:, -1:]], axis=1).tolist()]
    assert got == [w.tolist() for w in val_ref]


def test_resume_mid_epoch_gives_the_uninterrupted_batches(megatron_data):
    _, prepared, _ = megatron_data
    full = TrainLoader(prepared, S, B, seed=9, dp_rank=0, dp_world_size=1)
    n = full.steps_per_epoch
    expected = [next(full) for _ in range(n + 3)]
    first = TrainLoader(prepared, S, B, seed=9, dp_rank=0, dp_world_size=1)
    for _ in range(n - 2):
        next(first)
    resumed = TrainLoader(prepared, S, B, seed=9, dp_rank=0, dp_world_size=1)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as saved with a checkpoint
    for want in expected[n - 2:]:
        got = next(resumed)
        assert all(torch_equal(got[k], want[k]) for k in ("input_ids", "labels", "sample_ids"))


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


# --------------------------------------------------------------------------------------------
# vocabulary, verification, mixing, tokenizer directories
# --------------------------------------------------------------------------------------------


def test_ids_beyond_the_model_vocabulary_name_the_file(megatron_data):
    docs, prepared, tmp = megatron_data
    top = max(int(d.max()) for d in docs)
    check_compatible(prepared, 1000)  # the tokenizer's 1000 tokens: fine
    with pytest.raises(ConfigError) as e:
        check_compatible(prepared, top)
    assert "web_text_document" in str(e.value) and f"token id {top}" in str(e.value) \
        and f"model.vocab_size to at least {top + 1}" in str(e.value)


def test_changed_files_are_detected_when_opened(tmp_path, small_tok, capsys):
    """A .bin changed with its size and modification time kept (`touch -r`) keeps the preparation
    key: opening refuses it (training too), `smelt-ds data prepare` prepares that key again from
    the file as it is now, atomically (no temporary left), so the fix the refusal names works."""
    docs = random_documents(40, 1000, seed=6)
    write_megatron(tmp_path / "m", docs, np.uint16)
    cfg = _cfg(tmp_path, [{"megatron": str(tmp_path / "m")}], small_tok)
    prepared = prepare_from_config(cfg)
    assert main(["data", "verify", str(prepared.root)]) == 0
    assert "; 1 token files match their sizes and sampled sha256" in capsys.readouterr().out
    checkpointed = TrainLoader(prepared, 32, 2, seed=1, dp_rank=0, dp_world_size=1)
    next(checkpointed)
    loader_state = checkpointed.state_dict()  # as a checkpoint saved before the file changed holds it
    bin_, data = tmp_path / "m.bin", (tmp_path / "m.bin").read_bytes()
    kept = bin_.stat()
    ids = np.frombuffer(data, dtype=np.uint16).copy()
    ids[0] ^= 1  # the first id of document 0 (ids are 2..999: still one of the tokenizer's)
    ids.tofile(bin_)
    os.utime(bin_, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # touch -r: same size, same modification time
    PreparedData.load(prepared.root, verify="size")
    changed = rf"m\.bin.*sampled sha256 differs.*so its preparation key is too, and '{prepared.root}' is reused.*" \
              r"run `smelt-ds data prepare --recipe RECIPE` with the recipe that prepared it"
    with pytest.raises(ConfigError, match=changed):
        PreparedData.load(prepared.root)
    with pytest.raises(ConfigError, match=changed):  # training and eval: refused, not prepared behind their back
        prepare_from_config(cfg)
    assert main(["data", "verify", str(prepared.root)]) == 2
    capsys.readouterr()
    recipe = {"data": cfg.model_dump(mode="json"), "model": {"vocab_size": 1024}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["data", "prepare", "--recipe", str(tmp_path / "r.yaml")]) == 0
    out, err = capsys.readouterr()
    assert "prepared now" in out and f"m.bin changed since {prepared.root} was prepared" in err
    again = prepare_from_config(cfg)  # what training opens now: verified, the same key and directory
    assert (again.key, again.root) == (prepared.key, prepared.root)
    resumed = TrainLoader(again, 32, 2, seed=1, dp_rank=0, dp_world_size=1)
    with pytest.raises(ConfigError, match=rf"train split of '{again.root}' changed since the checkpoint.*"
                                          r"restore the files.*train\.init_from"):
        resumed.load_state_dict(loader_state)  # a resume would read other documents at the same positions
    TrainLoader(prepared, 32, 2, seed=1, dp_rank=0, dp_world_size=1).load_state_dict(loader_state)
    docs[0][0] ^= 1
    _check_read_back(again, packed(docs))
    assert [p.name for p in prepared.root.parent.iterdir()] == [prepared.root.name]
    bin_.write_bytes(data[:-2])
    with pytest.raises(ConfigError, match=rf"m\.bin.*has {len(data) - 2:,} bytes, {len(data):,} when it was prepared"):
        PreparedData.load(prepared.root, verify="size")
    with pytest.raises(ConfigError, match=r"m\.bin.*truncated"):  # a new key: prepared again, the .bin refused
        prepare_from_config(cfg)


def test_a_waiting_rank_that_finds_the_preparation_moved_aside_waits_for_the_new_one(tmp_path, small_tok,
                                                                                   monkeypatch):
    """Rank 1 of `data prepare` (RANK=1 in this process) whose open comes just after rank 0 moved
    the changed preparation aside: it waits for the one rank 0 builds (done here by a thread
    running the build rank 0 runs, at that moment) instead of failing on a missing directory."""
    import threading

    import smelt_ds.data.prepare as prepare_module
    from smelt_ds.data.cache import build_dir_atomically

    docs = random_documents(40, 1000, seed=6)
    write_megatron(tmp_path / "m", docs, np.uint16)
    cfg = _cfg(tmp_path, [{"megatron": str(tmp_path / "m")}], small_tok)
    old = prepare_from_config(cfg)
    kept = (tmp_path / "m.bin").stat()
    ids = np.fromfile(tmp_path / "m.bin", dtype=np.uint16)
    ids[0] ^= 1
    ids.tofile(tmp_path / "m.bin")
    os.utime(tmp_path / "m.bin", ns=(kept.st_atime_ns, kept.st_mtime_ns))
    real_run_once, rank0 = prepare_module.run_once, []

    def run_once_then_rank0_moves_it(out, build, **kw):
        done = real_run_once(out, build, **kw)
        if not rank0:  # rank 0, right after this rank saw the old directory complete
            os.replace(out, tmp_path / "aside")
            rank0.append(threading.Thread(target=lambda: (time.sleep(0.3), build_dir_atomically(out, build))))
            rank0[0].start()
        return done

    monkeypatch.setattr(prepare_module, "run_once", run_once_then_rank0_moves_it)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    again = prepare_from_config(cfg, reprepare_changed=True)
    rank0[0].join()
    assert (again.root, again.created) == (old.root, False)
    docs[0][0] ^= 1
    _check_read_back(again, packed(docs))


def test_text_and_token_sources_mix_with_one_tokenizer(tmp_path, small_tok, megatron_data):
    """A JSONL source after a Megatron source: the text source's shards equal a text-only
    preparation's, the Megatron documents come back exactly, both domains have validation."""
    docs, _, meg_dir = megatron_data
    texts = [" ".join(f"w{i}" for i in d) for d in random_documents(40, 1000, seed=7)]
    text_src = {"path": str(write_jsonl(tmp_path / "words.jsonl", texts)), "domain": "words"}
    mixed = prepare_from_config(_cfg(tmp_path, [{"megatron": str(meg_dir / "web_text_document")}, text_src],
                                     small_tok))
    alone = prepare_from_config(_cfg(tmp_path, [text_src], small_tok))
    assert read_split(mixed, "train", "words").tolist() == read_split(alone, "train", "words").tolist()
    assert read_split(mixed, "validation", "words").tolist() == read_split(alone, "validation", "words").tolist()
    _check_read_back(mixed, packed(docs), domain="web_text_document")
    assert mixed.domains == ["web_text_document", "words"]
    assert [s["index"] for s in mixed.meta["sources"]] == [0, 1]


def test_transformers_tokenizer_directory(tmp_path, small_tok):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(small_tok), eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(tmp_path / "hf-tok")
    docs = random_documents(30, 1000, seed=8)
    write_flat(tmp_path / "t.bin", docs, np.uint16, header=False)
    src = {"tokens": str(tmp_path / "t.bin"), "token_dtype": "uint16", "eot_id": EOT}
    prepared = prepare_from_config(_cfg(tmp_path, [src], tmp_path / "hf-tok"))
    backend = AutoTokenizer.from_pretrained(str(tmp_path / "hf-tok")).backend_tokenizer
    assert prepared.tokenizer_hash == tokenizer_hash(backend) == tokenizer_hash(prepared.tokenizer())
    assert (prepared.eot_id, prepared.pad_id) == (EOT, 1)
    _check_read_back(prepared, packed(docs))


# --------------------------------------------------------------------------------------------
# end to end: smelt-ds train on a Megatron source
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_on_a_megatron_source_records_the_users_tokenizer(tmp_path, small_tok, megatron_data):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=load_tokenizer(small_tok), eos_token="<|endoftext|>",
                            pad_token="<|pad|>").save_pretrained(tmp_path / "hf-tok")
    _, _, meg_dir = megatron_data
    raw = yaml.safe_load((ROOT / "recipes" / "tiny" / "smelt.yaml").read_text())
    raw["data"] = {"sources": [{"megatron": str(meg_dir / "web_text_document"), "domain": "web"}],
                   "tokenizer": {"path": str(tmp_path / "hf-tok")}, "validation_share": 0.1,
                   "cache_dir": str(tmp_path / "cache")}
    raw["train"].update(seq_len=32, micro_batch_size=2, max_steps=3, warmup_steps=1, log_every=1, eval_every=3,
                        save_every=3, run_dir=str(tmp_path / "run"))
    raw["eval"] = {"eval_batches": 1}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "smelt_ds.cli", "train", str(tmp_path / "r.yaml")],
                          capture_output=True, text=True, timeout=scaled_timeout(300), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    backend = AutoTokenizer.from_pretrained(str(tmp_path / "hf-tok")).backend_tokenizer
    assert tokenizer_hash(load_tokenizer(run / "tokenizer.json")) == tokenizer_hash(backend)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert "web" in json.loads((run / "summary.json").read_text())["validation_loss"]
