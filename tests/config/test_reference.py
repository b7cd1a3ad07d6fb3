"""docs/configuration.md (``smelt-ds config reference``) against pydantic's own JSON schema of the
run config: every field, its description, its allowed values and its default; and the page in the
checkout is the one the command writes now."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from smelt_ds import cli
from smelt_ds.config.reference import reference_markdown, undescribed_fields
from smelt_ds.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"

#: leaf fields declared without a ``description``: none (a new field must have one)
UNDESCRIBED: set[str] = set()


def _schema_leaves() -> dict[str, dict[str, Any]]:
    """``{dotted path: JSON-schema property}`` of every leaf field, read from
    ``RunConfig.model_json_schema()`` (pydantic's own walk of the models): a property whose schema
    refers to another model (directly, as list items, as mapping values, or inside anyOf) is a
    section, written ``path``, ``path[]`` or ``path.<name>``."""
    schema = RunConfig.model_json_schema()
    defs = schema["$defs"]
    out: dict[str, dict[str, Any]] = {}

    def model_ref(prop: dict[str, Any]) -> tuple[str, str] | None:
        if "$ref" in prop:
            return prop["$ref"].split("/")[-1], ""
        if "items" in prop and (inner := model_ref(prop["items"])):
            return inner[0], "[]"
        if isinstance(prop.get("additionalProperties"), dict) and (inner := model_ref(prop["additionalProperties"])):
            return inner[0], ".<name>"
        for alt in prop.get("anyOf", []):
            if inner := model_ref(alt):
                return inner
        return None

    def walk(model: dict[str, Any], prefix: str) -> None:
        for name, prop in model["properties"].items():
            path = f"{prefix}.{name}" if prefix else name
            ref = model_ref(prop)
            if ref is None:
                out[path] = {**prop, "required": name in model.get("required", [])}
            else:
                walk(defs[ref[0]], path + ref[1])

    walk(schema, "")
    return out


def _page_rows(text: str) -> dict[str, list[str]]:
    """``{field: [type, default, description]}`` of the page's table rows (``\\|`` inside a cell kept)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[m.group(1)] = cells[1:]
    return rows


#: a recipe whose every list or mapping of sections holds one item (built-in data sources by default;
#: one cluster layout with only its required fields), where the defaults pydantic's schema leaves out
#: (``default_factory``) can be read
_FILLED = RunConfig(cluster={"layouts": {"h100": {"gpu": "H100", "device_memory_gib": 79.1}}})


def _instance_default(path: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``path`` in :data:`_FILLED` dumped as JSON (``[]``: the first list item,
    ``<name>``: the first mapping value)."""
    value: Any = _FILLED.model_dump(mode="json")
    for part in path.split("."):
        key, is_list = part.removesuffix("[]"), part.endswith("[]")
        if key == "<name>" and isinstance(value, dict) and value:
            value = next(iter(value.values()))
            continue
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
        if is_list:
            if not value:
                return False, None
            value = value[0]
    return True, value


def test_every_field_has_its_schema_description_values_and_default():
    leaves = _schema_leaves()
    rows = _page_rows(reference_markdown())
    assert sorted(rows) == sorted(leaves), (sorted(set(leaves) - set(rows)), sorted(set(rows) - set(leaves)))
    for path, prop in leaves.items():
        kind, default, description = rows[path]
        assert description == " ".join(prop.get("description", "").split()), path
        for value in prop.get("enum", []) + [v for alt in prop.get("anyOf", []) for v in alt.get("enum", [])]:
            assert json.dumps(value) in kind, (path, value, kind)
        if prop["required"]:
            assert default == "required", path
            continue
        if "default" in prop:
            expected = prop["default"]
        else:  # a default_factory: the schema has no default, an instance does
            found, expected = _instance_default(path)
            assert found, path
        shown = default.strip("`")
        assert (shown if isinstance(expected, str) else json.loads(shown)) == expected, (path, default, expected)


def test_bounds_and_nested_sections_are_shown():
    rows = _page_rows(reference_markdown())
    assert rows["model.dropout"][0] == "float, >= 0, < 1"          # Field(ge=0, lt=1)
    assert rows["model.head_dim"][0] == "int | null, > 0"
    assert rows["train.betas"][0] == "[float, float]" and rows["train.betas"][1] == "`[0.9, 0.95]`"
    assert rows["cluster.layouts.<name>.gpu"][1] == "required"
    assert rows["deepspeed.config"][0] == "mapping of str to any"
    # a class named in a docstring reads as the section it is
    assert "is `moe_runtime`; the loss coefficients are in `train`" in reference_markdown()


def test_undescribed_fields_only_shrink():
    missing = set(undescribed_fields())
    assert missing <= UNDESCRIBED, f"fields without a description (add Field(description=...)): {missing - UNDESCRIBED}"
    assert UNDESCRIBED <= missing, f"these fields have a description now: remove them from UNDESCRIBED: " \
                                   f"{UNDESCRIBED - missing}"


def test_the_checkout_page_is_up_to_date(capsys):
    rc = cli.main(["config", "reference", "--check"])
    assert rc == 0, capsys.readouterr().err


def test_check_fails_on_a_stale_page_and_names_the_command(tmp_path, capsys):
    page = tmp_path / "docs" / "configuration.md"
    assert cli.main(["config", "reference", "-o", str(page)]) == 0
    assert page.read_text() == reference_markdown()
    assert cli.main(["config", "reference", "-o", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace("residual stream width H", "residual width"))
    capsys.readouterr()
    assert cli.main(["config", "reference", "-o", str(page), "--check"]) == 1
    assert f"run `smelt-ds config reference -o {page}`" in capsys.readouterr().err
