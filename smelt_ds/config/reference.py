"""The recipe reference (``docs/configuration.md``), written from the config tree itself: every
section of :class:`~smelt_ds.config.run.RunConfig` and every field with its YAML type, default and
pydantic ``description`` (which states the unit). ``smelt-ds config reference`` writes or checks it.

A section is a field whose type holds a config model (``model``, ``train.activation_checkpointing``,
``data.sources[]`` for a list of them, ``cluster.layouts.<name>`` for a mapping); every other field
is a row of its section's table.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from smelt_ds.config.run import RunConfig

HEADER = """\
# Configuration reference

<!-- Written by `smelt-ds config reference` from the pydantic field descriptions of the run config
(smelt_ds/config/); do not edit by hand. tests/config/test_reference.py fails when it is out of date. -->

A recipe is a YAML file whose keys are these field names, section by section; `--set
section.field=VALUE` overrides one field from the command line (the value read as YAML; a number
indexes a list: `--set loop.ranges.0.repeats=3`). Unknown keys are refused with the allowed ones
listed. Checks between fields (divisibility, backend rules, the loop ranges against
`model.num_layers`) run when the recipe is loaded and name the fields they compare. How to write
and combine recipes (`base:`, `smelt-ds config show`): [Recipes and budgets](budgets.md).
"""

#: how a section is reached from its parent: ``""`` a plain field, ``"[]"`` a list item, ``".<name>"`` a mapping value
_Container = Literal["", "[]", ".<name>"]


@dataclass(frozen=True)
class Section:
    """One config model in the tree: its dotted path (``train.activation_checkpointing``,
    ``data.sources[]``) and the model class."""

    path: str
    model: type[BaseModel]


def _models_in(annotation: Any) -> list[tuple[type[BaseModel], _Container]]:
    """The config models an annotation holds, with how (plain, list item, mapping value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for a in args for m in _models_in(a)]
    if origin in (list, tuple, set, frozenset):
        return [(m, "[]") for a in args for m, _ in _models_in(a)]
    if origin is dict and len(args) == 2:
        return [(m, ".<name>") for m, _ in _models_in(args[1])]
    return []


def sections(root: type[BaseModel] = RunConfig, path: str = "") -> list[Section]:
    """Every config model under ``root`` in declaration order, depth first (``root`` itself first,
    with path ``""``)."""
    out = [Section(path, root)]
    for name, field in root.model_fields.items():
        for model, how in _models_in(field.annotation):
            out += sections(model, f"{path}.{name}{how}" if path else f"{name}{how}")
    return out


def type_name(annotation: Any) -> str:
    """A field's type as a recipe writer reads it: ``int``, ``float | null``, ``"a" | "b"``,
    ``list[str]``, ``mapping of str to any``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, set, frozenset):
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    if isinstance(annotation, type):
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(annotation.__name__,
                                                                                 annotation.__name__)
    return str(annotation)


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def bounds(field: FieldInfo) -> str:
    """The numeric bounds pydantic checks (``> 0``, ``>= 0, < 1``), or ``""``."""
    out = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{sign} {value}")
    return ", ".join(out)


def default_text(field: FieldInfo) -> str:
    """The default as YAML flow text (``null``, ``[0.9, 0.95]``, ``{}``), or ``required``."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value


def plain_docstring(model: type[BaseModel], paths: dict[str, str] | None = None) -> str:
    """A model's docstring as Markdown: Sphinx roles and double backticks become code spans, a
    config class named in a role becomes its section path (``paths``: class name -> path),
    paragraphs are kept."""
    if model.__doc__ is None:
        return ""
    doc = inspect.cleandoc(model.__doc__)
    doc = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{(paths or {}).get(m.group(1), m.group(1))}`", doc)
    doc = doc.replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    return "\n\n".join(p for p in paragraphs if p)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_text(section: Section, paths: dict[str, str] | None = None) -> str:
    """One section: its heading, its model's docstring (``paths`` as for :func:`plain_docstring`),
    and a table of its leaf fields."""
    title = f"`{section.path}`" if section.path else "Top level"
    lines = [f"## {title}", ""]
    doc = plain_docstring(section.model, paths)
    if doc:
        lines += [doc, ""]
    rows = []
    nested = []
    for name, field in section.model.model_fields.items():
        key = f"{section.path}.{name}" if section.path else name
        if _models_in(field.annotation):
            how = _models_in(field.annotation)[0][1]
            nested.append(f"`{key}{how}`")
            continue
        kind = type_name(field.annotation)
        limit = bounds(field)
        default = "required" if field.is_required() else f"`{_cell(default_text(field))}`"
        rows.append(f"| `{key}` | {_cell(kind + (', ' + limit if limit else ''))} | {default} | "
                    f"{_cell(field.description or '')} |")
    if rows:
        lines += ["| field | type | default | description |", "|---|---|---|---|", *rows, ""]
    if nested:
        lines += [f"Sections: {', '.join(nested)}.", ""]
    return "\n".join(lines)


def reference_markdown() -> str:
    """The whole of ``docs/configuration.md``."""
    found = sections()
    paths = {s.model.__name__: s.path for s in found if s.path}
    return HEADER + "\n" + "\n".join(section_text(s, paths) for s in found)


def undescribed_fields() -> list[str]:
    """Dotted paths of the leaf fields that have no ``description`` (their row says nothing but type
    and default)."""
    out = []
    for section in sections():
        for name, field in section.model.model_fields.items():
            if not _models_in(field.annotation) and not field.description:
                out.append(f"{section.path}.{name}" if section.path else name)
    return out
