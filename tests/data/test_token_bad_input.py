"""Token sources: damaged files, ids outside the tokenizer, a raw file's dtype declared wrong,
recipe mistakes, a model vocabulary below the tokenizer, and `smelt-ds data inspect` (its numbers
against the files' writers, its exit codes). Every refusal names the file (or field), the
problem and the fix."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from smelt_ds.cli import main
from smelt_ds.config.data import DataConfig
from smelt_ds.config.loading import config_from_dict, load_config
from smelt_ds.data.loader import check_compatible
from smelt_ds.data.prepare import PreparedData, prepare_from_config
from smelt_ds.data.token_files import open_flat
from smelt_ds.errors import ConfigError
from tests.data.token_test_utils import EOT, random_documents, word_tokenizer, write_flat, write_megatron

DOCS = random_documents(30, 1000, seed=11)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 1000)


def _megatron(tmp: Path, dtype=np.uint16, docs=DOCS) -> Path:
    return write_megatron(tmp / "m", docs, dtype)


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _truncate(path: Path, drop: int) -> None:
    path.write_bytes(path.read_bytes()[:-drop] if drop else b"")


def _as_int32_bin(tmp: Path) -> None:
    prefix = _megatron(tmp)
    ids = np.fromfile(prefix.with_suffix(".bin"), dtype=np.uint16)
    ids.astype(np.int32).tofile(prefix.with_suffix(".bin"))  # the .idx still says uint16


def _bad_doc_index(tmp: Path) -> None:
    idx = _megatron(tmp).with_suffix(".idx")
    seqs, docs = struct.unpack("<QQ", idx.read_bytes()[18:34])
    _patch(idx, 34 + 12 * seqs + 8 * (docs - 1), struct.pack("<q", seqs + 5))


def _npy_truncated(tmp: Path) -> None:
    write_flat(tmp / "f.npy", DOCS, np.uint32, header=True)
    _truncate(tmp / "f.npy", 4)


# name -> (make(tmp), source kind, source extras, inspect options, message pattern)
MEGATRON = {"megatron": "m"}
CASES = {
    "truncated .bin": (lambda t: _truncate(_megatron(t).with_suffix(".bin"), 3), MEGATRON, [],
                       r"m\.bin.*the \.bin has [\d,]+ bytes, the index describes .* \(truncated\): use the \.idx"),
    "bad magic": (lambda t: _patch(_megatron(t).with_suffix(".idx"), 0, b"XX"), MEGATRON, [],
                  r"m\.idx.*not a Megatron-LM index: it starts with b'XXIDIDX"),
    "wrong version": (lambda t: _patch(_megatron(t).with_suffix(".idx"), 9, struct.pack("<Q", 2)), MEGATRON, [],
                      r"m\.idx.*index version 2, not 1.*write the dataset again"),
    "unknown dtype code": (lambda t: _patch(_megatron(t).with_suffix(".idx"), 17, bytes([9])), MEGATRON, [],
                           r"m\.idx.*dtype code 9 is not a Megatron-LM DType code"),
    "float dtype": (lambda t: _patch(_megatron(t).with_suffix(".idx"), 17, bytes([7])), MEGATRON, [],
                    r"m\.idx.*dtype float32 \(code 7\): the \.bin holds floats, not token ids"),
    "truncated index": (lambda t: _truncate(_megatron(t).with_suffix(".idx"), 8), MEGATRON, [],
                        r"m\.idx.*the index has [\d,]+ bytes, but its header \(.* sequences, .* document indices\) "
                        r"needs [\d,]+: the index is truncated"),
    "short index": (lambda t: _truncate(_megatron(t).with_suffix(".idx"), (t / "m.idx").stat().st_size - 20),
                    MEGATRON, [], r"m\.idx.*truncated: 20 bytes, shorter than its 34-byte header"),
    "bin of another dtype": (_as_int32_bin, MEGATRON, [],
                             r"m\.bin.*the size fits int32: the index and the \.bin were written with "
                             r"different dtypes"),
    "empty index": (lambda t: _truncate(_megatron(t).with_suffix(".idx"), 0), MEGATRON, [],
                    r"m\.idx.*the Megatron index \(\.idx\) is empty \(0 bytes\)"),
    "empty bin": (lambda t: _truncate(_megatron(t).with_suffix(".bin"), 0), MEGATRON, [],
                  r"m\.bin.*the \.bin is empty \(0 bytes\)"),
    "missing bin": (lambda t: _megatron(t).with_suffix(".bin").unlink(), MEGATRON, [],
                    r"m\.bin.*no such Megatron data file \(\.bin\) beside its \.idx"),
    "document indices": (_bad_doc_index, MEGATRON, [],
                         r"m\.idx.*document indices must rise from 0 to the sequence count"),
    "negative id": (lambda t: _megatron(t, np.int32, [np.array([5, -1, 7])] + DOCS), MEGATRON, [],
                    r"'.*m'.*holds token id -1: token ids are never negative"),
    "empty flat file": (lambda t: (t / "f.bin").write_bytes(b""), {"tokens": "f.bin", "token_dtype": "uint16"},
                        ["--token-dtype", "uint16"], r"f\.bin.*the token file is empty \(0 bytes\)"),
    "raw size": (lambda t: (t / "f.bin").write_bytes(b"\x02\x00" * 3), {"tokens": "f.bin", "token_dtype": "uint32"},
                 ["--token-dtype", "uint32"], r"f\.bin.*6 bytes is not a whole number of uint32 tokens"),
    "raw without dtype": (lambda t: write_flat(t / "f.bin", DOCS, np.uint16, header=False), {"tokens": "f.bin"}, [],
                          r"f\.bin.*a raw token file \(no np\.save header\) does not record its dtype: set "),
    "npy dtype differs": (lambda t: write_flat(t / "f.npy", DOCS, np.uint32, header=True),
                          {"tokens": "f.npy", "token_dtype": "uint16"}, ["--token-dtype", "uint16"],
                          r"f\.npy.*the file's header says uint32, "
                          r"`(data.sources\[0\].token_dtype|--token-dtype)` says uint16"),
    "npy int64": (lambda t: write_flat(t / "f.npy", DOCS, np.int64, header=True), {"tokens": "f.npy"}, [],
                  r"f\.npy.*np\.save file of dtype <i8, not uint16 or uint32"),
    "npy truncated": (_npy_truncated, {"tokens": "f.npy"}, [], r"f\.npy.*the header says [\d,]+ tokens .* truncated"),
    "npy 2-D": (lambda t: np.save(t / "f.npy", np.zeros((4, 4), np.uint16)), {"tokens": "f.npy"}, [],
                r"f\.npy.*np\.save file of shape \(4, 4\), not 1-D"),
    "npy header": (lambda t: (t / "f.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': garbage}\n"),
                   {"tokens": "f.npy"}, [], r"f\.npy.*the \.npy header cannot be read"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_file_is_refused_by_prepare_and_inspect(case, tmp_path, tok, capsys):
    make, source, options, pattern = CASES[case]
    make(tmp_path)
    kind = "megatron" if "megatron" in source else "tokens"
    src = {**source, kind: str(tmp_path / source[kind])}
    if kind == "tokens":
        src["eot_id"] = EOT
    with pytest.raises(ConfigError, match=pattern):
        prepare_from_config(DataConfig(sources=[src], tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))
    capsys.readouterr()
    assert main(["data", "inspect", src[kind], *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"smelt-ds data inspect: {src[kind]}: ")
    assert len(re.findall(pattern, err)) == 1


def test_ids_outside_the_tokenizer_and_a_wrong_eot_id(tmp_path, tok, capsys):
    docs = [d.copy() for d in DOCS]
    docs[4][0] = 1500
    write_megatron(tmp_path / "m", docs, np.uint16)
    cfg = DataConfig(sources=[{"megatron": str(tmp_path / "m")}], tokenizer={"path": str(tok)},
                     cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"'.*/m' \(data.sources\[0\]\): holds token id 1500, but the tokenizer "
                                          r"\(data.tokenizer.path '.*tokenizer.json'\) has ids 0..999: the file was "
                                          r"made with another tokenizer"):
        prepare_from_config(cfg)
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "m"), "--tokenizer", str(tok)]) == 2
    assert "holds token id 1500, but the tokenizer (--tokenizer" in capsys.readouterr().err
    write_flat(tmp_path / "f.npy", DOCS, np.uint16, header=True)
    absent = min(set(range(2, 1000)) - {int(i) for d in DOCS for i in d})  # an id no document holds
    with pytest.raises(ConfigError, match=rf"f\.npy.*no end-of-text id {absent} in its .* tokens.*`data.sources\[0\]"
                                          r"\.eot_id` is not the id"):
        prepare_from_config(DataConfig(sources=[{"tokens": str(tmp_path / "f.npy"), "eot_id": absent}],
                                       tokenizer={"path": str(tok), "eot_token": f"w{absent}"},
                                       cache_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError, match=r"`data.sources\[0\].eot_id` \(5, token 'w5'\) is not the id of "
                                          r"`data.tokenizer.eot_token` \('<\|endoftext\|>' = 0\).*set "
                                          r"data.tokenizer.eot_token to 'w5'"):
        prepare_from_config(DataConfig(sources=[{"tokens": str(tmp_path / "f.npy"), "eot_id": 5}],
                                       tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("data, pattern", [
    ({"sources": [{"megatron": "m"}]}, r"`data.tokenizer.path` \(unset\): token sources \(data.sources\[0\]\)"),
    ({"sources": [{"tokens": "f.npy"}], "tokenizer": {"path": "t.json"}},
     r"`data.sources\[0\].eot_id` \(unset\): flat token files are cut into documents at the end-of-text id"),
    ({"sources": [{"megatron": "m", "text_field": "body"}], "tokenizer": {"path": "t.json"}},
     r"`data.sources\[0\].text_field` \('body'\) does not apply to a megatron source"),
    ({"sources": [{"megatron": "m", "max_documents": 3}], "tokenizer": {"path": "t.json"}},
     r"`data.sources\[0\].max_documents` \(3\) does not apply to a megatron source"),
    ({"sources": [{"path": "a.txt", "eot_id": 0}]},
     r"`data.sources\[0\].eot_id` \(0\) does not apply to a path source \(only token sources"),
    ({"sources": [{"megatron": "m", "tokens": "f"}], "tokenizer": {"path": "t.json"}},
     r"`data.sources\[0\]` \(.*\) must set exactly one of path, dataset, builtin, megatron, tokens"),
    ({"sources": [{"megatorn": "m"}]}, r"unknown key `megatorn` in `data.sources\[0\]`.*did you mean `megatron`\?"),
    ({"sources": [{"tokens": "f", "eot_id": 0, "token_dtype": "int64"}], "tokenizer": {"path": "t.json"}},
     r"`data.sources\[0\].token_dtype` \('int64'\).*'uint16' or 'uint32'"),
])
def test_recipe_mistakes_name_the_field(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict({"data": data})


def test_recipe_errors_give_the_yaml_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  tokenizer:\n    path: t.json\n"
                      "  sources:\n    - tokens: f.npy\n      tokn_dtype: uint16\n")
    with pytest.raises(ConfigError, match=r"unknown key `tokn_dtype` in `data.sources\[0\]` \(line 6 of .*r.yaml\): "
                                          r"did you mean `token_dtype`\?"):
        load_config(recipe)


@pytest.mark.parametrize("value, pattern", [
    ("nowhere/m", r"`data.sources\[0\].megatron` \('.*nowhere/m'\): no Megatron .idx/.bin pair there"),
    ("empty-dir", r"`data.sources\[0\].megatron` \('.*empty-dir'\): no Megatron .idx/.bin pair there .*`data.sources"
                  r"\[0\].glob`"),
])
def test_missing_megatron_paths(tmp_path, tok, value, pattern):
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "empty-dir" / "notes.txt").write_text("not a dataset")
    with pytest.raises(ConfigError, match=pattern):
        prepare_from_config(DataConfig(sources=[{"megatron": str(tmp_path / value)}], tokenizer={"path": str(tok)},
                                       cache_dir=str(tmp_path / "c")))


def test_inspect_prints_what_the_writers_wrote(tmp_path, tok, capsys):
    prefix = write_megatron(tmp_path / "m", DOCS, np.uint16)
    write_flat(tmp_path / "f.npy", DOCS, np.uint32, header=True)
    top = max(int(d.max()) for d in DOCS)
    assert main(["data", "inspect", str(prefix), str(tmp_path / "f.npy"), "--eot-id", str(EOT),
                 "--tokenizer", str(tok)]) == 0
    meg, flat = capsys.readouterr().out.split(f"\n{tmp_path / 'f.npy'}\n")
    stored = sum(len(d) + (i % 2 == 0) for i, d in enumerate(DOCS))  # write_megatron appends eod to every other
    assert "Megatron-LM indexed dataset" in meg and "dtype        uint16" in meg
    assert f"documents    {len(DOCS)} (1 empty, {(len(DOCS) + 1) // 2} ended by end-of-text id 0)" in meg
    assert f"tokens       {stored:,}" in meg and f"largest id   {top:,}" in meg
    assert f"model.vocab_size >= {top + 1:,}" in meg and "tokenizer    fits" in meg
    flat_tokens = sum(len(d) for d in DOCS) + len(DOCS) - 1 + 1  # eot between documents, one extra after doc 1
    assert "np.save header" in flat and "dtype        uint32" in flat
    assert f"documents    {len(DOCS)} (1 empty, {len(DOCS)} ended by end-of-text id 0)" in flat
    assert f"tokens       {flat_tokens:,}" in flat
    assert main(["data", "inspect", str(tmp_path / "f.npy")]) == 0
    assert "unknown: give --eot-id" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# a raw file's token_dtype declared wrong (the ids the tokenizer has do not always catch it)
# --------------------------------------------------------------------------------------------


def _ids(n: int, high: int, seed: int) -> np.ndarray:
    """``n`` ids in [2, high), every 200th the end-of-text id, as int64."""
    ids = np.random.default_rng(seed).integers(2, high, n)
    ids[199::200] = EOT
    return ids


LITTLE = "set `{}` to uint32"
BIG = r"write the ids again as little-endian uint32 \(ids.astype\('<u4'\).tofile\(path\)\) and set `{}` to uint32"


@pytest.mark.parametrize("high, order, seen, fix", [
    (1000, "<u4", r"every second uint16 is 0 \(those at odd positions, in the whole file\): the file holds "
                  r"little-endian uint32 token ids below 65,536", LITTLE),
    (150_000, "<u4", r"every second uint16 is at most 2, while the others reach [\d,]+ \(those at odd positions, "
                     r"in the whole file\): the file holds little-endian uint32 token ids below 196,608", LITTLE),
    (1000, ">u4", r"every second uint16 is 0 \(those at even positions, in the whole file\): the file holds "
                  r"big-endian uint32 token ids below 65,536", BIG),
], ids=["ids below 65,536", "ids up to 150,000", "big-endian"])
def test_uint32_ids_declared_uint16_are_refused(tmp_path, tok, capsys, high, order, seen, fix):
    """uint32 ids written by numpy, declared uint16: refused when preparing and by `data inspect`
    (exit 2), naming the file, what was seen and the fix; the same file declared uint32 prepares.
    With ids up to 150,000 every uint16 is an id of a 150,000-token tokenizer: only this check
    can tell."""
    _ids(20_000, high, seed=1).astype(order).tofile(tmp_path / "code.u32.bin")
    src = {"tokens": str(tmp_path / "code.u32.bin"), "token_dtype": "uint16", "eot_id": EOT}
    if high == 1000:  # preparing: with the tokenizer the ids were made with
        field = r"data.sources\[0\].token_dtype"
        with pytest.raises(ConfigError, match=rf"code\.u32\.bin': read as uint16 \(`{field}`\), {seen}, each read as "
                                              rf"two uint16: {fix.format(field)}$"):
            prepare_from_config(DataConfig(sources=[src], tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))
    capsys.readouterr()
    assert main(["data", "inspect", src["tokens"], "--token-dtype", "uint16", "--eot-id", "0"]) == 2
    assert re.search(rf"^smelt-ds data inspect: .*code\.u32\.bin: .*{seen}, each read as two uint16: "
                     rf"{fix.format('--token-dtype')}$", capsys.readouterr().err)
    if order == "<u4" and high == 1000:
        prepared = prepare_from_config(DataConfig(sources=[{**src, "token_dtype": "uint32"}],
                                                  tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))
        assert prepared.meta["token_files"][0]["documents"] == 100


def test_real_uint16_files_that_look_alike_in_places_are_read(tmp_path):
    """No false refusal: DNA-like ids 0..3 whose end-of-text ids (4) all fall on even positions (so
    every odd one is at most 3), and a 6 MiB uint16 corpus whose first MiB happens to hold id 0 at
    every odd position (the spread sample sees the rest). Reference: the ids numpy wrote."""
    dna = np.random.default_rng(2).integers(0, 4, 40_000)
    dna[::1000] = 4
    dna.astype(np.uint16).tofile(tmp_path / "dna.bin")
    text = _ids(3 << 20, 1000, seed=3)
    text[1:1 << 19:2] = 0  # the first MiB: (x, 0) pairs
    text.astype(np.uint16).tofile(tmp_path / "text.bin")
    for name, ids in (("dna.bin", dna), ("text.bin", text)):
        tf = open_flat(tmp_path / name, "uint16")
        assert np.array_equal(tf.tokens(), ids)


def test_uint16_ids_declared_uint32_are_refused(tmp_path, tok, capsys):
    """The opposite: uint16 ids read as uint32 pair up into ids of 65,536 and more, beyond a
    tokenizer below 65,536 ids; the refusal names token_dtype uint16 as a fix."""
    _ids(20_000, 1000, seed=4).astype(np.uint16).tofile(tmp_path / "f.bin")
    src = {"tokens": str(tmp_path / "f.bin"), "token_dtype": "uint32", "eot_id": EOT}
    top = int(np.fromfile(tmp_path / "f.bin", dtype=np.uint32).max())  # numpy's reading as uint32
    assert top >= 65_536
    fix = r"holds uint16 ids read as uint32 .*: set `{}` to uint16 if the file was written as uint16"
    with pytest.raises(ConfigError, match=rf"f\.bin' \(data.sources\[0\]\): holds token id {top}, but the tokenizer .*"
                                          + fix.format(r"data.sources\[0\].token_dtype")):
        prepare_from_config(DataConfig(sources=[src], tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))
    capsys.readouterr()
    assert main(["data", "inspect", src["tokens"], "--token-dtype", "uint32", "--tokenizer", str(tok)]) == 2
    assert re.search(fix.format("--token-dtype"), capsys.readouterr().err)
    assert main(["data", "inspect", src["tokens"], "--token-dtype", "uint32", "--eot-id", "0"]) == 2
    assert "`--token-dtype` (uint32) is not the dtype the file was written with" in capsys.readouterr().err


def test_a_model_vocabulary_below_a_given_tokenizer_names_model_vocab_size(tmp_path, tok):
    """With data.tokenizer.path the tokenizer's size is fixed: the fix is model.vocab_size (padded
    to a multiple of 128), never data.tokenizer.vocab_size (which only sizes a trained one)."""
    write_megatron(tmp_path / "m", random_documents(30, 900, seed=5), np.uint16)  # ids below 900
    prepared = prepare_from_config(DataConfig(sources=[{"megatron": str(tmp_path / "m")}],
                                              tokenizer={"path": str(tok)}, cache_dir=str(tmp_path / "c")))
    check_compatible(prepared, 1000)
    with pytest.raises(ConfigError) as e:
        check_compatible(prepared, 950)
    assert re.search(r"`model.vocab_size` \(950\) is smaller than the tokenizer of the prepared data \(1000 tokens.*"
                     r"set model.vocab_size to at least 1000 \(e.g. 1024, padded to a multiple of 128 .*"
                     rf"data.tokenizer.path \('{tok}'\)", str(e.value))
    assert "data.tokenizer.vocab_size" not in str(e.value)
    meta = {**prepared.meta, "config": {**prepared.meta["config"], "tokenizer": {"path": None}}}  # as if trained
    with pytest.raises(ConfigError, match=r"set model.vocab_size to 1000, or prepare the data with "
                                          r"data.tokenizer.vocab_size=950"):
        check_compatible(PreparedData(prepared.root, meta), 950)


def test_ids_beyond_the_recipes_model_vocabulary_are_refused_by_prepare_and_inspect(tmp_path, tok, capsys):
    """An id at or above the recipe's model.vocab_size used to be found only when training started;
    `data prepare --recipe` and `data inspect --recipe` now refuse it with training's message (the file,
    the id, the field and its value, the fix). An id just below it passes."""
    import yaml

    f = write_flat(tmp_path / "f.npy", DOCS, np.uint16, header=True)
    top = max(int(d.max()) for d in DOCS)
    assert top < 1000

    def recipe(vocab: int) -> Path:
        path = tmp_path / f"r{vocab}.yaml"
        path.write_text(yaml.safe_dump({"name": "r", "model": {"vocab_size": vocab},
                                        "data": {"sources": [{"tokens": str(f), "eot_id": EOT}],
                                                 "tokenizer": {"path": str(tok)}}}))
        return path

    low = recipe(top)                                           # id `top` has no row
    capsys.readouterr()
    assert main(["data", "prepare", "--recipe", str(low), "--cache-dir", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (   # after the progress lines
        f"smelt-ds data: error: --recipe {low}: {str(f)!r} (data.sources[0]) holds token id {top}, not below "
        f"`model.vocab_size` ({top}): the model has no row for it; set model.vocab_size to at least {top + 1} (a "
        "multiple of 128 is usual), or drop the file from the source (the data are prepared and cached; training "
        "the recipe would stop here)")
    assert main(["data", "inspect", str(f), "--eot-id", str(EOT), "--recipe", str(low)]) == 2
    assert capsys.readouterr().err == (
        f"smelt-ds data inspect: {f}: {str(f)!r} (data inspect) holds token id {top}, not below `model.vocab_size` "
        f"({top} in {low}): the model has no row for it; set model.vocab_size in {low} to at least {top + 1} (a "
        "multiple of 128 is usual), or drop the file from the source\n")
    fits = recipe(top + 1)                                      # a row for every id
    assert main(["data", "inspect", str(f), "--eot-id", str(EOT), "--recipe", str(fits)]) == 0
    assert f"model        fits: model.vocab_size {top + 1:,} in {fits}" in capsys.readouterr().out
    assert main(["data", "prepare", "--recipe", str(recipe(1024)), "--cache-dir", str(tmp_path / "c")]) == 0
