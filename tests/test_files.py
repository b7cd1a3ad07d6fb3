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
