"""`smelt-ds data tokenize`: JSONL / text -> Megatron .bin/.idx and numpy .npy token files.

References: the ids are those of ``tokenizers`` itself (``encode``, special-token text as plain
text) with one end-of-text per document; the index is megatron-core's ``IndexedDatasetBuilder``'s,
byte for byte; the .npy is ``np.save``'s. Round trips: ``data inspect``, the token-file reader,
preparation (the packed stream) and a short training of the tiny recipe. Interrupted runs are real
processes killed with SIGKILL, then run again: the files equal an uninterrupted run's.
"""

from __future__ import annotations

import fcntl
import io
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from smelt_ds.cli import main
from smelt_ds.config.data import DataConfig, TokenizerConfig
from smelt_ds.config.loading import load_config
from smelt_ds.data.prepare import prepare_from_config
from smelt_ds.data.pretokenize import WORK_SUFFIX
from smelt_ds.data.token_files import open_flat, open_megatron
from smelt_ds.data.token_writers import NPY_HEADER_BYTES, megatron_dtype, npy_header, write_megatron_index
from smelt_ds.data.tokenizer import train_tokenizer
from smelt_ds.runs.tokenizer_file import load_tokenizer, tokenizer_hash
from smelt_ds.testing import run_distributed, scaled_timeout
from tests.data.data_test_utils import encode_documents, prose, split_at_eot, write_jsonl
from tests.data.token_test_utils import megatron_builder, read_split

ROOT = Path(__file__).resolve().parents[2]
EOT = 0  # <|endoftext|> of train_tokenizer's tokenizers
CHUNK = "1500"  # --chunk-bytes of the tests: many chunks from a small corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte-level BPE of 300 tokens, and documents: prose, one holding the literal end-of-text
    text, one of non-ASCII text; plus the JSONL file of them with a blank line and a
    whitespace-only document (both skipped)."""
    tmp = tmp_path_factory.mktemp("tokenize")
    docs = prose(40) + ["see <|endoftext|> inside, as plain text", "naïve café — ünïcödé ✓"] + prose(20, seed=3)
    tok = train_tokenizer([prose(200)], TokenizerConfig(vocab_size=300))
    tok.save(str(tmp / "tokenizer.json"))
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    lines.insert(5, "")
    lines.insert(9, json.dumps({"text": "  \n "}))
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    expected = encode_documents(tmp / "tokenizer.json", docs, EOT)
    return tmp, tmp / "tokenizer.json", tmp / "docs.jsonl", expected


def _tokenize(inp: Path, out: Path, tok: Path, *extra: str) -> int:
    return main(["data", "tokenize", "--input", str(inp), "-o", str(out), "--tokenizer", str(tok), "--chunk-bytes",
                 CHUNK, *extra])


def _megatron_documents(prefix: Path) -> list[list[int]]:
    tf = open_megatron(prefix)
    bounds, ids = tf.document_bounds(0, tf.num_documents), tf.tokens()
    return [ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


# ---------------------------------------------------------------------------------------------
# the writers against the formats' own writers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_index_is_megatron_cores_byte_for_byte(tmp_path, dtype):
    """Documents of one and of several sequences, and an empty document, through megatron-core's
    builder and through write_megatron_index: the same .idx bytes."""
    rng = np.random.default_rng(0)
    builder = megatron_builder()(str(tmp_path / "ref.bin"), dtype=dtype)
    lengths, doc_index = [], [0]
    for d in range(50):
        seq = [int(x) for x in rng.integers(1, 30, 1 + d % 3)] if d != 7 else []
        builder.add_document(rng.integers(0, 300, sum(seq)), seq)
        lengths += seq
        doc_index.append(len(lengths))
    builder.finalize(str(tmp_path / "ref.idx"))
    write_megatron_index(tmp_path / "ours.idx", np.dtype(dtype), np.array(lengths), np.array(doc_index))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()
    # one sequence per document (document_indices generated)
    builder = megatron_builder()(str(tmp_path / "one.bin"), dtype=dtype)
    for n in lengths:
        builder.add_document(np.zeros(n, dtype=np.int64), [n])
    builder.finalize(str(tmp_path / "one.idx"))
    write_megatron_index(tmp_path / "ours1.idx", np.dtype(dtype), np.array(lengths))
    assert (tmp_path / "ours1.idx").read_bytes() == (tmp_path / "one.idx").read_bytes()


def test_dtype_and_npy_header_are_the_references():
    DType = pytest.importorskip("megatron.core.datasets.indexed_dataset").DType
    for ids in (300, 65_499, 65_500, 128_256):
        assert megatron_dtype(ids) == np.dtype(DType.optimal_dtype(ids))
    for dtype, n in ((np.uint16, 0), (np.uint16, 7), (np.uint32, 10**12)):
        buf = io.BytesIO()
        np.save(buf, np.zeros(min(n, 7), dtype=dtype))
        ref = buf.getvalue()[:NPY_HEADER_BYTES]
        assert len(npy_header(np.dtype(dtype), n)) == NPY_HEADER_BYTES
        if n <= 7:
            assert npy_header(np.dtype(dtype), n) == ref


# ---------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------


def test_megatron_round_trip_through_inspect_and_the_reader(corpus, tmp_path, capsys):
    _, tok, inp, expected = corpus
    assert _tokenize(inp, tmp_path / "web_text_document", tok) == 0
    out = capsys.readouterr()
    assert f"{len(expected)} documents, {sum(map(len, expected)):,} tokens" in out.out
    assert "skipped 1 blank_line, 1 empty_document" in out.out
    assert "10% of the input" in out.err and "100% of the input" in out.err  # progress lines (not a terminal)
    assert _megatron_documents(tmp_path / "web_text_document") == expected
    assert open_megatron(tmp_path / "web_text_document").dtype == np.uint16
    assert not (tmp_path / ("web_text_document" + WORK_SUFFIX)).exists()
    assert main(["data", "inspect", str(tmp_path / "web_text_document"), "--eot-id", str(EOT),
                 "--tokenizer", str(tok)]) == 0
    text = capsys.readouterr().out
    assert f"documents    {len(expected)} (0 empty, {len(expected)} ended by end-of-text id 0)" in text
    assert f"tokens       {sum(map(len, expected)):,}" in text and "tokenizer    fits" in text
    # the preparation reads every document once, in order, each ended by one end-of-text
    cfg = DataConfig(sources=[{"megatron": str(tmp_path / "web_text_document")}], validation_share=0,
                     tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "cache"))
    assert split_at_eot(read_split(prepare_from_config(cfg), "train"), EOT) == expected


def test_npy_round_trip_and_no_append_eod(corpus, tmp_path, capsys):
    _, tok, inp, expected = corpus
    assert _tokenize(inp, tmp_path / "web.npy", tok, "--format", "npy") == 0
    assert np.load(tmp_path / "web.npy").tolist() == [i for d in expected for i in d]  # np.save's format
    tf = open_flat(tmp_path / "web.npy", None)
    assert tf.format == "npy" and tf.dtype == np.uint16
    cfg = DataConfig(sources=[{"tokens": str(tmp_path / "web.npy"), "eot_id": EOT}], validation_share=0,
                     tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "cache"))
    assert split_at_eot(read_split(prepare_from_config(cfg), "train"), EOT) == expected
    # Megatron without --append-eod: the documents' own ids; the .npy refuses it (documents end at eot)
    assert _tokenize(inp, tmp_path / "bare", tok, "--no-append-eod") == 0
    assert _megatron_documents(tmp_path / "bare") == [d[:-1] for d in expected]
    capsys.readouterr()
    assert _tokenize(inp, tmp_path / "bare.npy", tok, "--format", "npy", "--no-append-eod") == 2
    assert "--no-append-eod with --format npy" in capsys.readouterr().err


def test_the_recipes_tokenizer_and_a_text_input(corpus, tmp_path, capsys):
    """No --tokenizer: data.tokenizer.path of --recipe. A text file read per paragraph."""
    _, tok, _, _ = corpus
    paragraphs = [p.strip() for p in prose(12, seed=5)]  # a paragraph break takes the whitespace around it
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  tokenizer:\n    path: {tok}\n")
    assert main(["data", "tokenize", "--input", str(tmp_path / "book.txt"), "-o", str(tmp_path / "book"),
                 "--recipe", str(recipe), "--sample-by", "paragraph"]) == 0
    assert _megatron_documents(tmp_path / "book") == encode_documents(tok, paragraphs, EOT)
    assert tokenizer_hash(load_tokenizer(tok)) in capsys.readouterr().out


@pytest.mark.slow
def test_workers_1_and_2_write_the_same_bytes(corpus, tmp_path):
    _, tok, inp, _ = corpus
    for fmt, name in (("megatron", "m"), ("npy", "m.npy")):
        assert _tokenize(inp, tmp_path / "w1" / name, tok, "--format", fmt, "--workers", "1") == 0
        assert _tokenize(inp, tmp_path / "w2" / name, tok, "--format", fmt, "--workers", "2") == 0
    for name in ("m.bin", "m.idx", "m.npy"):
        assert (tmp_path / "w2" / name).read_bytes() == (tmp_path / "w1" / name).read_bytes(), name


def _train(rank, world, recipe, sets):
    from smelt_ds.train.loop import train

    return train(load_config(recipe, sets)).losses


@pytest.mark.slow
def test_the_tiny_recipe_trains_on_the_written_files(corpus, tmp_path):
    _, tok, inp, expected = corpus
    assert _tokenize(inp, tmp_path / "web_text_document", tok) == 0
    run_dir = tmp_path / "run"
    sets = ["model.vocab_size=320", "model.hidden_size=32", "model.num_layers=4", "model.num_heads=4",
            "model.num_kv_heads=2", "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2",
            "moe.expert_ffn_size=32", f"data.sources=[{{megatron: {tmp_path / 'web_text_document'}}}]",
            f"data.tokenizer.path={tok}", "data.validation_share=0.1", f"data.cache_dir={tmp_path / 'cache'}",
            "train.seq_len=32", "train.micro_batch_size=2", "train.max_steps=3", "train.warmup_steps=1",
            "train.log_every=1", "train.eval_every=100", "train.save_every=100", "eval.eval_batches=1",
            f"train.run_dir={run_dir}"]
    recipe = str(ROOT / "recipes" / "tiny" / "smelt.yaml")
    prepared = prepare_from_config(load_config(recipe, sets).data)
    stream = np.concatenate([read_split(prepared, "train"), read_split(prepared, "validation")])
    assert sorted(split_at_eot(stream, EOT)) == sorted(expected)  # every document once, in one split
    (losses,) = run_distributed(_train, 1, args=(recipe, sets), timeout=300)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert tokenizer_hash(load_tokenizer(run_dir / "tokenizer.json")) == tokenizer_hash(load_tokenizer(tok))


# ---------------------------------------------------------------------------------------------
# interrupted runs: SIGKILL, then the same command again
# ---------------------------------------------------------------------------------------------

#: runs `smelt-ds data tokenize ARGS` and sends itself SIGKILL at a chosen point: in the middle of
#: writing the KILL_AT-th chunk (half its ids written after the last committed state), or just
#: before the new .idx is renamed into place (the .bin already is)
KILLER = """
import os, signal, sys
from smelt_ds.cli import main
from smelt_ds.data import pretokenize

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    where, at = os.environ["KILL_WHERE"], int(os.environ["KILL_AT"])
    seen = [0]
    if where == "chunk":
        real_append = pretokenize._Output.append
        def append(self, ids, lengths):
            seen[0] += 1
            if seen[0] == at:
                self._tokens.write(ids[:len(ids) // 2].tobytes())
                self._tokens.flush()
                kill()
            real_append(self, ids, lengths)
        pretokenize._Output.append = append
    else:
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith(".idx"):
                kill()
            real_replace(src, dst)
        pretokenize.os.replace = replace
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("fmt,where", [("megatron", "chunk"), ("megatron", "rename"), ("npy", "chunk")])
def test_killed_run_continues_to_the_same_bytes(corpus, tmp_path, fmt, where, capsys):
    _, tok, inp, _ = corpus
    name = "web.npy" if fmt == "npy" else "web"
    assert _tokenize(inp, tmp_path / "ref" / name, tok, "--format", fmt) == 0  # uninterrupted, one process
    (tmp_path / "killer.py").write_text(KILLER)
    out = tmp_path / "out" / name
    argv = ["data", "tokenize", "--input", str(inp), "-o", str(out), "--tokenizer", str(tok), "--chunk-bytes", CHUNK,
            "--format", fmt]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "KILL_WHERE": where,
           "KILL_AT": "4"}
    proc = subprocess.run([sys.executable, str(tmp_path / "killer.py"), *argv, "--workers", "2"], env=env,
                          capture_output=True, text=True, timeout=scaled_timeout(120))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    final = out.with_suffix(".idx") if fmt == "megatron" else out
    assert not final.exists()  # nothing that reads as a complete output
    work = out.with_name(out.name + WORK_SUFFIX)
    state = json.loads((work / "state.json").read_text())
    assert bool(state.get("finishing")) == (where == "rename")
    assert state["chunks"] == 3 if where == "chunk" else (tmp_path / "out" / "web.bin").is_file()
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 2  # refused: no complete output
    assert str(out) in capsys.readouterr().err
    assert main(argv + ["--workers", "1"]) == 0
    said = capsys.readouterr()
    assert f"continuing the interrupted run in {str(work)!r}: {state['chunks']} chunks" in said.err
    assert f"{state['chunks']} of them continued from the interrupted run" in said.out
    for ref in sorted((tmp_path / "ref").iterdir()):
        assert (tmp_path / "out" / ref.name).read_bytes() == ref.read_bytes(), ref.name
    assert not work.exists()


def _tokenize_interrupted(inp: Path, out: Path, tok: Path, monkeypatch) -> None:
    """A `data tokenize` run stopped by Ctrl-C (KeyboardInterrupt) at its third chunk, exit 130; the
    writer is restored afterwards."""
    from smelt_ds.data import pretokenize

    real, seen = pretokenize._Output.append, [0]

    def interrupted(self, ids, lengths):
        seen[0] += 1
        if seen[0] == 3:
            raise KeyboardInterrupt
        real(self, ids, lengths)

    monkeypatch.setattr(pretokenize._Output, "append", interrupted)
    assert _tokenize(inp, out, tok) == 130
    monkeypatch.setattr(pretokenize._Output, "append", real)


def test_changed_input_starts_again(corpus, tmp_path, capsys, monkeypatch):
    """An interrupted run (Ctrl-C at the third chunk), then the input changed: the partial files
    are not continued, the output is that of the new input."""
    _, tok, inp, _ = corpus
    mine = tmp_path / "docs.jsonl"
    mine.write_bytes(inp.read_bytes())
    _tokenize_interrupted(mine, tmp_path / "web", tok, monkeypatch)
    assert "run the same command again to continue" in capsys.readouterr().err
    docs = prose(30, seed=11)
    write_jsonl(mine, docs)
    assert _tokenize(mine, tmp_path / "web", tok) == 0
    assert "starting again: the inputs, the tokenizer or the options differ" in capsys.readouterr().err
    assert _megatron_documents(tmp_path / "web") == encode_documents(tok, docs, EOT)


def test_inspect_of_an_interrupted_output_says_to_rerun_the_tokenize(corpus, tmp_path, capsys, monkeypatch):
    """`data inspect` on the output of an interrupted `data tokenize` (Ctrl-C at the third chunk):
    not "no such file ... fix the path" but that the run was interrupted and how to finish it; the
    rerun finishes it and the same inspect then reads it."""
    _, tok, inp, expected = corpus
    out = tmp_path / "web"
    _tokenize_interrupted(inp, out, tok, monkeypatch)
    capsys.readouterr()
    work = out.with_name(out.name + WORK_SUFFIX)
    for given in (out, out.with_suffix(".idx")):
        assert main(["data", "inspect", str(given)]) == 2
        err = capsys.readouterr().err
        assert (f"smelt-ds data inspect: {given}: not written yet: the `smelt-ds data tokenize` that writes it was "
                f"interrupted (its chunks so far are in {str(work)!r}, which is never read as data): rerun the same "
                "`smelt-ds data tokenize` command to finish it") in err, err
        assert "fix the path" not in err
    assert _tokenize(inp, out, tok) == 0 and not work.exists()
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    assert f"tokens       {sum(len(d) for d in expected):,}" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_missing_key_names_file_line_and_key(corpus, tmp_path, capsys):
    _, tok, _, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(o) + "\n" for o in [{"text": "one"}, {"text": "two"}, {"body": "three"}]))
    assert _tokenize(bad, tmp_path / "x", tok) == 2
    err = capsys.readouterr().err
    assert f"file {str(bad)!r} line 3" in err and "without a string field 'text'" in err
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / ("x" + WORK_SUFFIX)).exists()
    assert _tokenize(bad, tmp_path / "y", tok, "--json-key", "body") == 2  # lines 1 and 2 lack `body`
    assert f"file {str(bad)!r} line 1" in capsys.readouterr().err


def test_unreadable_inputs_are_named(corpus, tmp_path, capsys):
    _, tok, _, _ = corpus
    assert _tokenize(tmp_path / "absent.jsonl", tmp_path / "x", tok) == 2
    assert f"--input {str(tmp_path / 'absent.jsonl')!r}: no such file or directory" in capsys.readouterr().err
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 8)
    assert _tokenize(tmp_path / "blob.txt", tmp_path / "x", tok) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "blob.txt") in err and "NUL byte" in err and "this is not text" in err
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps({"text": "caf"}).encode()[:-2] + b"\xe9\"}\n")
    assert _tokenize(tmp_path / "latin1.jsonl", tmp_path / "x", tok, "--set", "data.non_utf8=error") == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "latin1.jsonl") in err and "line 1" in err and "invalid UTF-8" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_a_file_without_read_permission_is_named(corpus, tmp_path, capsys):
    _, tok, inp, _ = corpus
    locked = tmp_path / "locked.jsonl"
    locked.write_bytes(inp.read_bytes())
    locked.chmod(0)
    assert _tokenize(locked, tmp_path / "x", tok) == 2
    assert f"--input file {str(locked)!r} cannot be read" in capsys.readouterr().err


def test_tokenizer_without_the_eot_token_and_a_second_writer_are_refused(corpus, tmp_path, capsys):
    _, tok, inp, _ = corpus
    assert _tokenize(inp, tmp_path / "x", tok, "--set", "data.tokenizer.eot_token=<|eos|>") == 2
    assert "`data.tokenizer.eot_token` ('<|eos|>') is not in the tokenizer's vocabulary" in capsys.readouterr().err
    work = tmp_path / ("y" + WORK_SUFFIX)
    work.mkdir()
    with open(work / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert _tokenize(inp, tmp_path / "y", tok) == 2
    assert "another `smelt-ds data tokenize` is writing this output now" in capsys.readouterr().err
    assert not (tmp_path / "y.idx").exists()
