"""Atomic writes (smelt_ds.files): the target holds the old or the complete new content, never a part."""

from __future__ import annotations

import json

import pytest

from smelt_ds.files import json_safe, write_atomic, write_json_atomic, write_text_atomic


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.md"
    write_text_atomic(target, "old")

    def half_then_crash(tmp):
        tmp.write_text("new but incompl")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, half_then_crash)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]
    write_text_atomic(target, "new")
    assert target.read_text() == "new"


def test_json_is_strict(tmp_path):
    obj = {"loss": float("nan"), 3: [float("inf"), 1.5, (2, "a")]}
    assert json_safe(obj) == {"loss": None, "3": [None, 1.5, [2, "a"]]}
    path = write_json_atomic(tmp_path / "r.json", obj)
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}")) == json_safe(obj)


def test_staged_directory_replaces_whole_or_not_at_all(tmp_path):
    import pytest

    from smelt_ds.files import staged_directory

    target = tmp_path / "out"
    mine = tmp_path / "out_partial"  # a user's directory with the name a fixed staging path would have
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with staged_directory(target) as tmp:
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with staged_directory(target) as tmp:
            (tmp / "b").write_text("2")
            raise RuntimeError("crash halfway")
    assert sorted(p.name for p in target.iterdir()) == ["a"]  # the earlier complete one is untouched
    with staged_directory(target) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["c"]
    assert (mine / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out_partial"]
