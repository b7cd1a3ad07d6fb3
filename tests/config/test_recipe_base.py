"""Recipes that extend another recipe (``base: PATH``), `smelt-ds config show/validate`, and the
shipped S/M/L/XL ablations, which extend their size's baseline.yaml, resolving to the recipes they
replaced.

The reference for the shipped recipes is the files as they were before they used ``base:``, kept
verbatim under tests/assets/recipes_before/<size>/ (copied from git, the commit before the
rewrite), Baselines included: a variant resolved today must equal its old file with whatever
changed in its Baseline since then applied (:func:`_expected`; with no Baseline change since, that
is the old file itself)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from smelt_ds.cli import main
from smelt_ds.config.loading import dump_config, load_config, read_recipe
from smelt_ds.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "tests" / "assets" / "recipes_before"
VARIANTS = ("smelt", "uniform", "bottom", "top", "asymmetric")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BASE = """\
name: base
model:
  hidden_size: 64
  num_layers: 4
train:
  max_steps: 100
  warmup_steps: 10
data:
  sources:
    - {path: a, domain: web}
    - {path: b, domain: code}
"""


def test_keys_merge_over_the_base_sections_by_key_and_lists_whole(tmp_path):
    _write(tmp_path / "s" / "base.yaml", BASE)
    child = _write(tmp_path / "m" / "child.yaml", "base: ../s/base.yaml\nname: child\nmodel:\n  num_layers: 6\n"
                                                  "data:\n  sources:\n    - {path: c, domain: web}\n")
    raw, lines = read_recipe(child)
    assert raw == {"name": "child", "model": {"hidden_size": 64, "num_layers": 6},
                   "train": {"max_steps": 100, "warmup_steps": 10},
                   "data": {"sources": [{"path": "c", "domain": "web"}]}}  # the list replaced, not merged
    base_file = str(tmp_path / "s" / "base.yaml")
    assert lines["model.hidden_size"] == (base_file, 3) and lines["model.num_layers"] == (str(child), 4)
    assert lines["data.sources[0].path"] == (str(child), 7) and "data.sources[1].path" not in lines
    cfg = load_config(child)
    assert (cfg.name, cfg.model.hidden_size, cfg.model.num_layers, [s.path for s in cfg.data.sources]) == \
        ("child", 64, 6, ["c"])
    # the run's config.yaml is the resolved recipe: that of the same recipe written out flat
    flat = _write(tmp_path / "flat.yaml", BASE.replace("name: base", "name: child").replace(
        "num_layers: 4", "num_layers: 6").replace("    - {path: a, domain: web}\n    - {path: b, domain: code}\n",
                                                  "    - {path: c, domain: web}\n"))
    assert "base" not in yaml.safe_load(dump_config(cfg)) and dump_config(cfg) == dump_config(load_config(flat))


def test_a_chain_of_bases_applies_nearest_last(tmp_path):
    _write(tmp_path / "a.yaml", BASE)
    _write(tmp_path / "b.yaml", "base: a.yaml\nmodel:\n  num_layers: 6\ntrain:\n  max_steps: 200\n")
    c = _write(tmp_path / "sub" / "c.yaml", "base: ../b.yaml\ntrain:\n  max_steps: 300\n")
    cfg = load_config(c, ["train.warmup_steps=5"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.train.max_steps, cfg.train.warmup_steps) == \
        (64, 6, 300, 5)


def test_a_cycle_of_bases_is_refused_naming_the_files(tmp_path):
    a = _write(tmp_path / "a.yaml", "base: b.yaml\nname: a\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\nname: b\n")
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert str(e.value) == (f"recipe file '{tmp_path / 'b.yaml'}': `base` ('a.yaml', line 1) makes a cycle of bases: "
                            f"{tmp_path / 'a.yaml'} -> {tmp_path / 'b.yaml'} -> {tmp_path / 'a.yaml'}: remove one of "
                            "these `base:` keys")
    _write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(ConfigError, match="makes a cycle of bases"):
        load_config(tmp_path / "self.yaml")


@pytest.mark.parametrize("base, problem", [("missing.yaml", "does not exist (looked for {tmp}/missing.yaml); the "
                                                            "path is relative to the recipe file"),
                                           ("[a.yaml]", "must be the path of the recipe this one extends")])
def test_a_bad_base_names_the_recipe_its_line_and_the_fix(tmp_path, base, problem):
    r = _write(tmp_path / "r.yaml", f"name: r\nbase: {base}\n")
    with pytest.raises(ConfigError) as e:
        load_config(r)
    assert str(e.value).startswith(f"recipe file '{r}': `base` ({yaml.safe_load(base)!r}, line 2) "
                                   + problem.format(tmp=tmp_path))


def test_errors_name_the_file_and_line_each_value_came_from(tmp_path):
    base = _write(tmp_path / "base.yaml", BASE.replace("  hidden_size: 64\n", "  hidden_size: 64\n  hiden: 1\n"))
    child = _write(tmp_path / "c.yaml", "base: base.yaml\ntrain:\n  max_steps: abc\n")
    msg = str(pytest.raises(ConfigError, load_config, child).value)
    assert f"unknown key `hiden` in `model` (line 4 of {base}): did you mean `hidden_size`?" in msg
    assert f"`train.max_steps` ('abc') (line 3 of {child}): Input should be a valid integer" in msg
    # a cross-field error: the field from the base names the base's line
    _write(base, BASE)
    _write(child, "base: base.yaml\ntrain:\n  max_steps: 20\n")
    with pytest.raises(ConfigError) as e:
        load_config(child, ["train.max_steps=5"])
    assert str(e.value).endswith(f"(`train.warmup_steps` at line 7 of {base})")


def test_config_show_prints_what_train_would_run(tmp_path, capsys):
    """`config show` equals the config `smelt-ds train` resolves before it launches
    (train.cli.check_before_launch, whose result the run's config.yaml dumps)."""
    import argparse

    from smelt_ds.train.cli import check_before_launch

    _write(tmp_path / "a.yaml", BASE)
    child = _write(tmp_path / "c.yaml", f"base: a.yaml\ntrain:\n  run_dir: {tmp_path / 'run'}\n")
    assert main(["config", "show", str(child), "--set", "train.max_steps=50", "--set", "model.num_layers=8"]) == 0
    shown = capsys.readouterr().out
    trained = check_before_launch(argparse.Namespace(recipe=str(child), set=["train.max_steps=50",
                                                                             "model.num_layers=8"],
                                                     run_dir=None, resume="none", nproc=1))
    assert shown == dump_config(trained)
    assert (trained.train.max_steps, trained.model.num_layers, trained.model.hidden_size) == (50, 8, 64)
    assert main(["config", "show", str(child), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == yaml.safe_load(dump_config(load_config(child)))  # same data


def test_config_validate_names_each_bad_recipe(tmp_path, capsys):
    good = _write(tmp_path / "good.yaml", BASE)
    bad = _write(tmp_path / "bad.yaml", "base: good.yaml\nmodel:\n  hiden_size: 3\n")
    assert main(["config", "validate", str(good), str(bad), str(good)]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{good}: ok (base)"] * 2
    assert err.startswith(f"smelt-ds config validate: error: {bad}: invalid configuration:\n  unknown key "
                          f"`hiden_size` in `model` (line 3 of {bad})")
    assert main(["config", "validate", str(good)]) == 0


# -- the shipped recipes ----------------------------------------------------------------------

def _expected(old_variant: dict[str, Any], old_base: dict[str, Any], new_base: dict[str, Any]) -> dict[str, Any]:
    """The old variant with its Baseline's changes since the snapshot applied: every leaf (list
    values whole) where the old variant agreed with the old Baseline takes the new Baseline's."""
    out = copy.deepcopy(old_variant)
    for k in set(old_base) | set(new_base):
        ob, nb = old_base.get(k), new_base.get(k)
        if ob == nb or (k in old_variant and old_variant.get(k) != ob and not isinstance(ob, dict)):
            continue
        if isinstance(ob, dict) and isinstance(nb, dict) and isinstance(old_variant.get(k), dict):
            out[k] = _expected(old_variant[k], ob, nb)
        elif k not in new_base:
            out.pop(k, None)
        else:
            out[k] = copy.deepcopy(nb)
    return out


@pytest.mark.parametrize("size", ["s", "m", "l", "xl"])
def test_shipped_ablations_extend_their_baseline_and_resolve_to_the_recipes_they_replaced(size):
    old_base = yaml.safe_load((BEFORE / size / "baseline.yaml").read_text())
    new_base = yaml.safe_load((ROOT / "recipes" / size / "baseline.yaml").read_text())
    for variant in VARIANTS:
        path = ROOT / "recipes" / size / f"{variant}.yaml"
        assert yaml.safe_load(path.read_text())["base"] == "baseline.yaml"
        old = yaml.safe_load((BEFORE / size / f"{variant}.yaml").read_text())
        assert read_recipe(path)[0] == _expected(old, old_base, new_base), f"{size}/{variant}"
        before_lines = (BEFORE / size / f"{variant}.yaml").read_text().splitlines()
        assert len(path.read_text().splitlines()) < len(before_lines) / 3  # the repetition is gone


def test_expected_applies_baseline_changes_the_variant_did_not_override():
    """The test's own reference: a Baseline change reaches the variant unless the variant set the field."""
    old_base = {"name": "b", "train": {"lr": 1, "steps": 5}, "loop": {"position": "none"}, "gone": 1}
    old_var = {"name": "v", "train": {"lr": 1, "steps": 5}, "loop": {"position": "middle"}, "gone": 1}
    new_base = {"name": "b", "train": {"lr": 2, "steps": 5, "new": 3}, "loop": {"position": "none"}}
    assert _expected(old_var, old_base, new_base) == {"name": "v", "train": {"lr": 2, "steps": 5, "new": 3},
                                                      "loop": {"position": "middle"}}
    assert _expected(old_var, old_base, old_base) == old_var
