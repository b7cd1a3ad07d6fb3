"""`smelt-ds data prepare` / `verify` from the command line."""

from __future__ import annotations

from smelt_ds.cli import main
from smelt_ds.data.prepare import PreparedData
from tests.data.data_test_utils import prose, write_jsonl


def test_prepare_then_reuse_then_verify(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", prose(60))
    b = write_jsonl(tmp_path / "b.jsonl", prose(40, seed=9))
    argv = ["data", "prepare", "--source", f"path={a},domain=alpha", "--source", f"path={b},domain=beta,weight=2",
            "--vocab-size", "300", "--validation-share", "0.1", "-o", str(tmp_path / "out"),
            "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 0
    assert "prepared now" in capsys.readouterr().out
    p = PreparedData.load(tmp_path / "out")
    assert p.domains == ["alpha", "beta"] and [s["weight"] for s in p.meta["sources"]] == [1.0, 2.0]
    assert p.meta["splits"]["validation"]["alpha"]["documents"] == 6
    assert main(argv) == 0
    assert "reused prepared output" in capsys.readouterr().out
    assert main(["data", "verify", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"ok: {len(p.meta['shards'])} shards" in out and "alpha" in out


def test_prepare_with_a_recipe_and_set(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", prose(50))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data:\n  sources:\n    - path: {a}\n      domain: web\n  tokenizer:\n    vocab_size: 300\n")
    assert main(["data", "prepare", "--recipe", str(recipe), "--set", "data.validation_share=0.2",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    root = next(line.split()[1] for line in out.splitlines() if line.startswith("prepared /"))
    assert PreparedData.load(root).meta["splits"]["validation"]["web"]["documents"] == 10


def test_bad_input_exits_2_with_one_clear_line(tmp_path, capsys):
    assert main(["data", "prepare", "--source", str(tmp_path / "missing.txt"), "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "`data.sources[0].path`" in err and "missing.txt" in err and "no such file or directory" in err
