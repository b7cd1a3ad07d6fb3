"""Reading a recipe into a :class:`~smelt_ds.config.run.RunConfig`: the YAML file (a key given twice
refused, the line of every key kept), its ``base:`` chain, ``--set a.b=v`` overrides, validation
whose errors name where each bad value came from (the file and line, or the ``--set`` item) and the
closest allowed key for a typo; and the way back, the resolved config as YAML (:func:`dump_config`).

Precedence: ``--set`` on the command line > the recipe > its bases > defaults. Keys that moved out
of ``moe:`` (runtime knobs, loss coefficients) are refused with their new place
(:data:`smelt_ds.config.moe.MOVED_MOE_KEYS`). Every problem raises
:class:`smelt_ds.errors.ConfigError` naming the field path, the value and the fix.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from smelt_ds.arguments import looks_like_override, override_hint
from smelt_ds.config.moe import MOVED_MOE_KEYS
from smelt_ds.config.run import RunConfig
from smelt_ds.errors import ConfigError
from smelt_ds.mappings import deep_merge

__all__ = ["KeyLines", "load_config", "read_recipe", "read_yaml_mapping", "read_yaml_with_lines",
           "apply_overrides", "config_from_dict", "validate_model", "config_diff", "config_to_dict", "dump_config"]


#: key path (``model.num_layers``, ``data.sources[0].path``) -> its line in the recipe file, or
#: ``(file, line)`` for a recipe assembled from several files (:func:`read_recipe`)
KeyLines = Mapping[str, "int | tuple[str, int]"]


class _Origin:
    """Where each value of a raw recipe came from: a line of a YAML file, or a ``--set``."""

    def __init__(self, file: str | None, lines: KeyLines | None, overrides: list[str] | None):
        #: key path -> (file, line); a bare line number is a line of ``file``
        self.lines = {k: v if isinstance(v, tuple) else (str(file), v) for k, v in (lines or {}).items()}
        self.overrides = _override_paths(overrides)

    def override_for(self, path: str) -> str | None:
        """The last ``--set`` item that set ``path``, a section above it or a field below it."""
        hits = [item for p, item in self.overrides if _related(path, p)]
        return hits[-1] if hits else None

    def line_of(self, path: str) -> tuple[str, int] | None:
        """``(file, line)`` of ``path`` (or of the nearest section above it that is in a file): the
        recipe's, or with ``base:`` the file of the chain that set it last."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = _parent_path(path)
        return None

    def at(self, paths: list[str]) -> str:
        """`` (line N of FILE)`` / `` (lines N, M of FILE; line K of BASE)`` for the paths read from files."""
        by_file: dict[str, set[int]] = {}
        for where in (self.line_of(p) for p in paths):
            if where is not None:
                by_file.setdefault(where[0], set()).add(where[1])
        if not by_file:
            return ""
        return " (" + "; ".join(f"line{'s' if len(ns) > 1 else ''} {', '.join(map(str, sorted(ns)))} of {f}"
                                for f, ns in by_file.items()) + ")"


def _parent_path(path: str) -> str:
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""


def _related(a: str, b: str) -> bool:
    """Whether key paths ``a`` and ``b`` are the same field or one is a section holding the other."""
    if not a or not b:
        return False
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def _override_paths(overrides: list[str] | None) -> list[tuple[str, str]]:
    """``(key path, item)`` per ``--set`` item in the order applied (list indices as ``[i]``)."""
    out = []
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        path = ""
        for part in key.split("."):
            path = f"{path}[{part}]" if part.isdigit() and path else (f"{path}.{part}" if path else part)
        out.append((path, item))
    return out


def _set_flag(item: str) -> str:
    """``--set ITEM`` as a shell would take it back (quoted only where needed)."""
    return f"--set {shlex.quote(item)}"


#: backticked field paths in a message: `moe.top_k`, `data.sources[1].path`
_FIELD_IN_MESSAGE = r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*)`"


def _validation_problems(err: ValidationError, root: type[BaseModel], origin: _Origin) -> list[tuple[str | None, str]]:
    """``(--set item or None, problem)`` per problem of ``err``, unknown keys first: a close match
    among the allowed keys is suggested (``difflib.get_close_matches``), else the allowed keys are
    listed; problems read from the file name their line."""
    unknown: dict[str, list[str]] = {}
    values: list[tuple[str | None, str]] = []
    for e in err.errors():
        loc = [f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]]  # list items: ranges[0]
        path = ".".join(loc).replace(".[", "[")
        if e["type"] == "extra_forbidden":
            unknown.setdefault(".".join(loc[:-1]).replace(".[", "["), []).append(loc[-1])
            continue
        blame = origin.override_for(path)
        values.append((blame, f"`{path}` ({e.get('input')!r}){'' if blame else origin.at([path])}: {e['msg']}"))
    out: list[tuple[str | None, str]] = []
    for parent, keys in unknown.items():
        allowed = _allowed_keys(parent, root)
        where = f"in `{parent}`" if parent else "at the top level"
        rest: dict[str | None, list[str]] = {}
        for key in keys:
            path = f"{parent}.{key}" if parent else key
            blame = origin.override_for(path)
            match = difflib.get_close_matches(key, allowed, n=1)
            if match:
                out.append((blame, f"unknown key `{key}` {where}{'' if blame else origin.at([path])}: "
                                   f"did you mean `{match[0]}`?"))
            else:
                rest.setdefault(blame, []).append(key)
        for blame, bad in rest.items():
            paths = [f"{parent}.{k}" if parent else k for k in bad]
            out.append((blame, f"unknown keys in `{parent or '<top level>'}`: {sorted(bad)}"
                               f"{'' if blame else origin.at(paths)}; allowed keys: {allowed}: remove or rename "
                               f"{'it' if len(bad) == 1 else 'them'}" + (_DEEPSPEED_HINT if parent == "deepspeed"
                                                                        else "")))
    return out + values


#: after an unknown key of the ``deepspeed`` section: where DeepSpeed's own JSON keys go
_DEEPSPEED_HINT = (" (the ZeRO stage is deepspeed.zero_stage, offloading deepspeed.offload_optimizer / "
                   "offload_param; DeepSpeed's other JSON keys go under deepspeed.config, e.g. "
                   "--set deepspeed.config.zero_optimization.reduce_bucket_size=500000000)")


def _join_problems(problems: list[tuple[str | None, str]], source: str) -> str:
    """One message: ``--set ITEM: problem`` when every problem comes from one ``--set``, else
    ``SOURCE: invalid configuration:`` and one line per problem (``--set ITEM: `` before those a
    ``--set`` caused)."""
    blames = {b for b, _ in problems}
    if len(problems) == 1 and None not in blames:
        blame, text = problems[0]
        return f"{_set_flag(blame or '')}: {text}"
    lines = [f"{_set_flag(b)}: {t}" if b else t for b, t in problems]
    head = "invalid --set overrides" if None not in blames else f"{source}: invalid configuration"
    return head + ":\n  " + "\n  ".join(lines)


def _blame_config_error(e: ConfigError, source: str, origin: _Origin) -> str:
    """A cross-field ConfigError, prefixed with the ``--set`` items that set a field it names
    (and the file lines of the other fields it names), else with ``source``."""
    msg = str(e)
    fields = list(dict.fromkeys(re.findall(_FIELD_IN_MESSAGE, msg)))
    blamed = list(dict.fromkeys(item for path, item in origin.overrides if any(_related(f, path) for f in fields)))
    if not blamed:
        return f"{source}: {msg}"
    from_file = {f: w for f in fields if origin.override_for(f) is None and (w := origin.line_of(f)) is not None}
    where = ""
    if from_file:
        files = {w[0] for w in from_file.values()}
        one = files.pop() if len(files) == 1 else None
        where = " (" + ", ".join(f"`{f}` at line {line}" + ("" if one else f" of {file}")
                                 for f, (file, line) in from_file.items()) + (f" of {one})" if one else ")")
    return f"{' '.join(_set_flag(b) for b in blamed)}: {msg}{where}"


def _allowed_keys(path: str, root: type[BaseModel]) -> list[str]:
    cls: Any = root
    for part in [p.split("[")[0] for p in path.split(".") if p]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:  # list[...] / Optional[...] of a model
            args = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
            inner = [a for a in args if issubclass(a, BaseModel)]
            if not inner:
                for a in getattr(ann, "__args__", ()):
                    inner += [x for x in getattr(a, "__args__", ()) if isinstance(x, type) and issubclass(x, BaseModel)]
            if not inner:
                return []
            cls = inner[0]
    return sorted(getattr(cls, "model_fields", {}).keys())


def config_from_dict(raw: dict[str, Any], source: str = "<dict>", overrides: list[str] | None = None,
                     key_lines: KeyLines | None = None) -> RunConfig:
    """Validate a raw recipe dict. Raises ConfigError naming ``source`` and the bad fields (see
    :func:`validate_model` for ``overrides`` and ``key_lines``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    return validate_model(RunConfig, raw, source, overrides, key_lines)


def validate_model(cls: type[BaseModel], raw: Any, source: str, overrides: list[str] | None = None,
                   key_lines: KeyLines | None = None):
    """``cls.model_validate(raw)``; a pydantic or cross-field error becomes one ConfigError
    naming each bad field, its value and the fix.

    An unknown key gets the closest allowed key (``did you mean `hidden_size`?``), or the list of
    allowed keys when none is close. A problem is blamed on where its value came from: the
    ``--set`` item of ``overrides`` (the ``--set KEY=VALUE`` strings applied to ``raw``) that set
    the field or a section holding it (``--set model.hiden_size=64: unknown key ...``), else
    ``source``, naming the line when ``key_lines`` (:data:`KeyLines`, from
    :func:`read_yaml_with_lines` or :func:`read_recipe`) knows it: ``(line 5 of SOURCE)``. A cross-field error naming a
    field a ``--set`` set starts with that ``--set``."""
    origin = _Origin(source, key_lines, overrides)
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_join_problems(_validation_problems(e, cls, origin), source)) from None
    except ConfigError as e:
        raise ConfigError(_blame_config_error(e, source, origin)) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a copy of a raw recipe dict.

    A path part that is an integer indexes a list (``--set loop.ranges.0.repeats=3``); index
    ``len(list)`` appends. Raises ConfigError for an override without ``=``, an empty path, a
    path through a plain value, or a list index out of range. Unknown keys are caught by
    validation afterwards (with the allowed keys listed).
    """
    out = copy.deepcopy(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set moe.top_k=2")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"--set {item!r}: empty key path; write it like model.hidden_size=128")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value {value.strip()!r} is not valid YAML "
                              f"({getattr(e, 'problem', None) or e}): quote it as a string, e.g. "
                              f"--set \"{key.strip()}='{value.strip()}'\", or fix the brackets") from None
        if len(parts) >= 2 and parts[0] == "moe" and parts[1] in MOVED_MOE_KEYS:
            new_key = f"{MOVED_MOE_KEYS[parts[1]]}.{'.'.join(parts[1:])}"
            raise ConfigError(f"--set {item!r}: `{key.strip()}` moved to `{new_key}`; write "
                              f"--set {new_key}={value.strip()}")
        node: Any = out
        for depth, p in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "the recipe"
            if isinstance(node, list):
                if not p.isdigit():
                    example = ".".join(parts[:depth] + ["0"] + parts[depth + 1:])
                    raise ConfigError(f"--set {item!r}: `{where}` is a list; index it with a number from 0 "
                                      f"(e.g. {example}), got {p!r}")
                idx = int(p)
                if idx > len(node) or (idx == len(node) and not last):
                    raise ConfigError(f"--set {item!r}: index {idx} is out of range for `{where}` "
                                      f"({len(node)} items; use 0..{len(node) - 1}, or {len(node)} to append)")
                if last:
                    if idx == len(node):
                        node.append(parsed)
                    else:
                        node[idx] = parsed
                    break
                node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[p] = parsed
                    break
                nxt = node.get(p)
                if nxt is None:
                    nxt = node[p] = {}
                node = nxt
            else:
                raise ConfigError(f"--set {item!r}: `{where}` is a value ({node!r}), not a section")
    return out


def config_diff(new: Any, old: Any, path: str = "", labels: tuple[str, str] = ("planned", "there")) -> list[str]:
    """Differences between two raw config dicts, one ``"path: OLD <labels[1]>, NEW <labels[0]>"``
    string per differing leaf (dicts are walked, other values compared whole)."""
    if isinstance(new, dict) and isinstance(old, dict):
        return [d for k in sorted(set(new) | set(old))
                for d in config_diff(new.get(k), old.get(k), f"{path}.{k}".lstrip("."), labels)]
    return [] if new == old else [f"{path}: {old!r} {labels[1]}, {new!r} {labels[0]}"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently).

    ``source`` names the file in messages; key paths (``model.num_layers``, ``data.sources[0].path``)
    are computed from the node tree before construction. Merge keys (``<<: *anchor``) may be
    overridden by the mapping's own keys, as YAML specifies.
    """

    source = "<yaml>"

    def construct_document(self, node: yaml.Node) -> Any:
        self._paths: dict[int, str] = {}
        self.key_lines: dict[str, int] = {}  # key path -> 1-based line of the key
        self._index_paths(node, "")
        return super().construct_document(node)

    def _index_paths(self, node: yaml.Node, path: str) -> None:
        if id(node) in self._paths:  # an alias: keep the first path, do not walk twice
            return
        self._paths[id(node)] = path
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                child = f"{path}.{key}" if path else str(key)
                if key_node.tag != "tag:yaml.org,2002:merge":
                    self.key_lines.setdefault(child, key_node.start_mark.line + 1)
                self._index_paths(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._index_paths(item, f"{path}[{i}]")

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable key: SafeConstructor raises its own error below
                    continue
                seen.setdefault(key, line)
                if first is not None:
                    parent = self._paths.get(id(node), "")
                    where = f"{parent}.{key}" if parent else str(key)
                    raise ConfigError(f"{self.source}: key `{where}` is given twice (lines {first} and {line}); "
                                      "YAML would silently keep only the last one: delete or merge one of them")
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                      ) -> dict[str, Any]:
    """The YAML mapping in ``path`` (empty file = {}). Raises ConfigError naming ``what`` and the
    file for a missing file, bad YAML, a key given twice in one mapping (at any level; both line
    numbers), or a document that is not a mapping."""
    return read_yaml_with_lines(path, what, example)[0]


def read_yaml_with_lines(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                         ) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`read_yaml_mapping` and the line of every key: ``(mapping, key_lines)`` with key paths
    such as ``model.hidden_size`` or ``data.sources[0].path`` -> 1-based line, for
    :func:`validate_model`'s messages. Raises ConfigError as :func:`read_yaml_mapping` does."""
    path = Path(path)
    if not path.is_file():
        if looks_like_override(str(path)):
            raise ConfigError(override_hint(str(path)))
        raise ConfigError(f"{what} {str(path)!r} does not exist: pass the path of a YAML file, e.g. {example}")
    loader = _UniqueKeyLoader(path.read_text())
    loader.source = f"{what} {str(path)!r}"
    try:
        raw = loader.get_single_data() or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {e}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r} must be a YAML mapping of sections, got {type(raw).__name__}")
    return raw, dict(getattr(loader, "key_lines", {}))


def _replaced_paths(base: Any, override: Any, path: str = "") -> list[str]:
    """Key paths where :func:`deep_merge` of ``override`` over ``base`` replaces a value whole."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return [path]
    return [p for k, v in override.items() for p in _replaced_paths(base.get(k), v, f"{path}.{k}" if path else str(k))]


def read_recipe(path: str | Path, what: str = "recipe file", example: str = "recipes/tiny/smelt.yaml"
                ) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """A recipe file with its ``base:`` chain resolved: ``(raw, key_lines)``, ``key_lines`` mapping
    each key path to ``(file, line)`` of the file that set it (for :func:`validate_model`).

    ``base: PATH`` (relative to the recipe file) names another recipe; this file's keys are
    deep-merged over it (:func:`deep_merge`: sections merge key by key, every other value, lists
    included, replaces the base's whole). The base may name a base in turn; a chain that comes
    back to a file is refused naming the files. Raises ConfigError as :func:`read_yaml_with_lines`
    does, and for a ``base`` that is not a path string or names no file."""
    return _read_recipe(Path(path), what, example, ())


def _read_recipe(path: Path, what: str, example: str, chain: tuple[Path, ...]
                 ) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    raw, lines = read_yaml_with_lines(path, what, example)
    shown = os.path.normpath(path) if chain else str(path)  # the recipe as given; its bases as found
    own = {k: (shown, n) for k, n in lines.items() if k != "base" and not k.startswith(("base.", "base["))}
    if "base" not in raw:
        return raw, own
    rel = raw.pop("base")
    where = f"{what} {shown!r}: `base` ({rel!r}, line {lines.get('base')})"
    if not isinstance(rel, str) or not rel.strip():
        raise ConfigError(f"{where} must be the path of the recipe this one extends, relative to this file, "
                          "e.g. base: baseline.yaml")
    base_path = path.parent / rel
    if not base_path.is_file():
        raise ConfigError(f"{where} does not exist (looked for {os.path.normpath(base_path)}); the path is "
                          "relative to the recipe file")
    chain += (path.resolve(),)
    if base_path.resolve() in chain:
        loop = " -> ".join(os.path.normpath(p) for p in chain + (base_path.resolve(),))
        raise ConfigError(f"{where} makes a cycle of bases: {loop}: remove one of these `base:` keys")
    base_raw, base_lines = _read_recipe(base_path, what, example, chain)
    replaced = _replaced_paths(base_raw, raw)
    kept = {k: v for k, v in base_lines.items() if not any(_related(k, r) for r in replaced)}
    return deep_merge(base_raw, raw), {**kept, **own}


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe (its ``base:`` chain resolved: :func:`read_recipe`), apply ``--set``
    overrides and validate.

    Raises ConfigError for a missing file, bad YAML, a bad ``base``, unknown keys or invalid
    values, naming the file and line, or the ``--set`` item, the bad value came from
    (:func:`validate_model`).
    """
    raw, lines = read_recipe(path)
    return config_from_dict(apply_overrides(raw, overrides), source=str(path), overrides=overrides, key_lines=lines)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain-data form of a config (JSON/YAML serialisable)."""
    return cfg.model_dump(mode="json")


def dump_config(cfg: RunConfig, path: str | Path | None = None) -> str:
    """Serialise a resolved config to YAML (and write it to ``path`` when given)."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
