"""DeepSpeed's own validation of a DeepSpeed config, before any process starts
(:func:`validate_deepspeed_config`).

``deepspeed.initialize`` parses its config with ``deepspeed.runtime.config.DeepSpeedConfig``:
each section through DeepSpeed's pydantic models (``DeepSpeedZeroConfig`` for
``zero_optimization``, the monitor, comms-logger, fp16/bf16, activation-checkpointing and
expert-parallel models, ...), which refuse unknown keys and values of the wrong type, then its
batch and consistency asserts. Here the same class parses the same dict, so a typo such as
``zero_optimization.overlap_com`` is refused when the recipe is loaded and in ``smelt-ds
preflight`` / ``render-job``, not by every rank after the job waited in the queue. No DeepSpeed
key is listed here: what is valid is what DeepSpeed's classes accept, and the closest key
suggested for an unknown one comes from the refusing model's own fields.

The one thing ``DeepSpeedConfig`` reads from a process group is the data-parallel world size
(``dist.get_world_size()``, which smelt-ds's engine leaves to DeepSpeed: no ``mpu``), for its
``train_batch_size = micro-batch x accumulation x world size`` assert. Without a process group
DeepSpeed takes a world of 1; :func:`validate_deepspeed_config` sets the world size it is given
instead.

Numbers in scientific notation: DeepSpeed's JSON examples write ``"reduce_bucket_size": 5e8``,
a number in JSON and YAML 1.2, but a YAML 1.1 reader (PyYAML, which reads recipes and ``--set``
values) reads ``5e8`` as the string ``'5e8'`` (its floats need a dot and a signed exponent:
``5.0e+8``). Such strings (:data:`SCIENTIFIC`) are read as numbers (an integer when whole), and
DeepSpeed's models then decide: a field that takes a string gets the text back as written; a
field that takes no such number refuses it, naming the fix (``write 500000000 or 5.0e+8``).
"""

from __future__ import annotations

import collections.abc
import copy
import difflib
import functools
import re
import reprlib
from typing import Any

from smelt_ds.errors import ConfigError
from smelt_ds.mappings import deep_merge

__all__ = ["SCIENTIFIC", "DS_CONFIG_DOCS", "read_scientific", "unread_keys", "validate_deepspeed_config"]

#: a number in scientific notation (``5e8``, ``1E-3``, ``2.5e+9``, ``5.0e8``) that YAML 1.1 reads as a string
SCIENTIFIC = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
#: DeepSpeed's description of its config keys
DS_CONFIG_DOCS = "https://www.deepspeed.ai/docs/config-json/"
#: the batch keys a section is validated beside when it is parsed on its own (:func:`_section_error`)
_ONE_SAMPLE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
#: the pydantic errors of a number DeepSpeed's field cannot take
_NUMBER_ERRORS = ("int_parsing", "float_parsing", "int_from_float", "int_type", "float_type")

#: a key path in a config: dict keys and list indices
KeyPath = tuple[str | int, ...]


def read_scientific(node: Any, path: KeyPath = ()) -> tuple[Any, dict[KeyPath, str]]:
    """``(copy of node, {path: text})``: every string of ``node`` (nested dicts and lists) that
    :data:`SCIENTIFIC` matches as a whole, read as a number (an ``int`` when it is whole, e.g.
    ``'5e8'`` -> 500000000; else a ``float``), and the text each path held."""
    if isinstance(node, dict):
        pairs = [(k, read_scientific(v, (*path, k))) for k, v in node.items()]
        return {k: v for k, (v, _) in pairs}, {p: t for _, (_, found) in pairs for p, t in found.items()}
    if isinstance(node, list):
        items = [read_scientific(v, (*path, i)) for i, v in enumerate(node)]
        return [v for v, _ in items], {p: t for _, found in items for p, t in found.items()}
    if isinstance(node, str) and SCIENTIFIC.fullmatch(node.strip()):
        number = float(node)
        return (int(number) if number.is_integer() else number), {path: node}
    return node, {}


@functools.cache
def _config_class() -> type:
    """``DeepSpeedConfig`` at a given world size (imported on first use: seconds)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parser: Any = DeepSpeedConfig  # untyped to the type checker

    class AtWorldSize(parser):
        """DeepSpeed's config parser with the world size of the job instead of the process
        group's (none here)."""

        def __init__(self, config: dict[str, Any], world_size: int):
            self._job_world_size = world_size
            super().__init__(config)

        def _configure_train_batch_size(self) -> None:
            self.world_size = self._job_world_size
            super()._configure_train_batch_size()

    return AtWorldSize


def _deepspeed_error(config: dict[str, Any], world_size: int) -> Exception | None:
    """What ``DeepSpeedConfig`` raises for ``config`` on ``world_size`` ranks, or None. Every
    exception counts: DeepSpeed refuses a config with pydantic's ValidationError, its own
    DeepSpeedConfigError, asserts, and a TypeError or ValueError for a section of the wrong shape."""
    try:
        _config_class()(copy.deepcopy(config), world_size)
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raises is its refusal
        return e
    return None


def _section_error(config: dict[str, Any]) -> tuple[str, Exception] | None:
    """The first top-level key whose section DeepSpeed refuses on its own (beside a batch of one
    sample), and the error; None when each passes alone (the sections clash)."""
    for key, value in config.items():
        if key in _ONE_SAMPLE or key == "train_batch_size":
            continue
        error = _deepspeed_error({**_ONE_SAMPLE, key: value}, 1)
        if error is not None:
            return key, error
    return None


@functools.cache
def _models_named(name: str) -> tuple[type, ...]:
    """DeepSpeed's pydantic models of that class name (a ValidationError names its model)."""
    from pydantic import BaseModel

    found, todo = [], list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__name__ == name and cls.__module__.startswith("deepspeed"):
            found.append(cls)
    return tuple(found)


def _keys_of(model: type) -> list[str]:
    """The keys a DeepSpeed model takes (names and aliases; deprecated ones left out)."""
    keys = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if not extra.get("deprecated"):
            keys += [name] + ([field.alias] if field.alias else [])
    return keys


def _submodel(model: type, loc: KeyPath) -> type | None:
    """The model of the section at ``loc`` inside ``model`` (None when it is not a model)."""
    from pydantic import BaseModel

    for part in loc:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}  # type: ignore[attr-defined]
        fields.update(model.model_fields)  # type: ignore[attr-defined]
        field = fields.get(str(part))
        if field is None:
            return None
        inner = [field.annotation, *getattr(field.annotation, "__args__", ())]
        models = [a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            return None
        model = models[0]
    return model


def _dotted(path: KeyPath) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _at(node: Any, path: KeyPath) -> Any:
    for part in path:
        node = node[part]
    return node


def _number_fix(value: Any, kind: str) -> str:
    """The fix for a value DeepSpeed's number field refuses (pydantic's error ``kind``)."""
    if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()) and not float(value).is_integer():
        return "write a whole number (this field of DeepSpeed's is an integer)"
    if isinstance(value, str):
        return "write it as a number (YAML reads 5e8 as a string: write 500000000 or 5.0e+8)"
    return "write a whole number" if kind == "int_from_float" else "write a number"


def _refusal(key: str, error: Exception, where: str, config: dict[str, Any]) -> tuple[KeyPath, str]:
    """``(path, message)`` of DeepSpeed's refusal of the section ``key`` (path from the top of
    the config): the field path, its value, DeepSpeed's message and the fix."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        text = str(error).strip() or type(error).__name__
        return (key,), (f"`{where}.{key}` ({reprlib.repr(config[key])}): DeepSpeed refuses it: {text}: fix or "
                        f"remove it (DeepSpeed's keys: {DS_CONFIG_DOCS})")
    first = error.errors()[0]
    inside: KeyPath = tuple(first["loc"])  # from the top of the refusing model
    models = _models_named(error.title)
    holds_section = bool(inside) and inside[0] == key and any(key in _keys_of(m) for m in models)
    loc = inside if holds_section else (key, *inside)  # a section's own model starts inside the section
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        parents = [m for m in (_submodel(m, inside[:-1]) for m in models) if m is not None]
        allowed = sorted({k for m in parents for k in _keys_of(m)})
        match = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = (f"did you mean `{where}.{_dotted((*loc[:-1], match[0]))}`?" if match else
               f"remove it (the keys it takes there: {', '.join(allowed)})")
        return loc, (f"`{where}.{_dotted(loc)}` ({value!r}) is not a key DeepSpeed takes: its {error.title} "
                     f"refuses it ({first['msg']}): {fix}")
    fix = (_number_fix(value, first["type"]) if first["type"] in _NUMBER_ERRORS
           else f"fix or remove it (DeepSpeed's keys: {DS_CONFIG_DOCS})")
    return loc, f"`{where}.{_dotted(loc)}` ({value!r}): DeepSpeed's {error.title} refuses it: {first['msg']}: {fix}"


def validate_deepspeed_config(passthrough: dict[str, Any], base: dict[str, Any] | None = None, world_size: int = 1,
                              where: str = "deepspeed.config") -> dict[str, Any]:
    """Parse ``base`` with ``passthrough`` merged in (:func:`smelt_ds.mappings.deep_merge`) with
    DeepSpeed's ``DeepSpeedConfig`` as ``deepspeed.initialize`` does, on ``world_size`` ranks.

    ``base`` is the rest of the DeepSpeed config (default: a micro-batch of one sample per rank);
    ``world_size`` counts the ranks of the data-parallel world (``train_batch_size`` in ``base``
    must be micro-batch x accumulation x ``world_size``, as DeepSpeed asserts). Numbers in
    scientific notation written as strings (:func:`read_scientific`) are read as numbers,
    except where DeepSpeed's field takes the string.

    Returns:
        ``passthrough`` with those numbers read (a new dict; the input is not modified).

    Raises:
        ConfigError: DeepSpeed refuses the config. The message names the field path under
            ``where`` (e.g. ``deepspeed.config.zero_optimization.overlap_com``), its value,
            DeepSpeed's own message and the fix: for an unknown key the closest key of the model
            that refused it (``difflib``), for a number the way to write it.
    """
    base = {**_ONE_SAMPLE} if base is None else base
    out, read = read_scientific(passthrough)
    for _ in range(len(read) + 1):
        config = deep_merge(base, out)
        error = _deepspeed_error(config, world_size)
        if error is None:
            return out
        found = _section_error(config)
        if found is None:
            raise ConfigError(f"`{where}`: DeepSpeed refuses the DeepSpeed config built from this recipe: "
                              f"{str(error).strip() or type(error).__name__}: fix or remove the keys of {where} it "
                              f"names (DeepSpeed's keys: {DS_CONFIG_DOCS})")
        loc, message = _refusal(*found, where, config)
        if loc in read:  # DeepSpeed's field takes no number here: give it the text as written
            container = _at(out, loc[:-1])
            container[loc[-1]] = read.pop(loc)
            continue
        raise ConfigError(message)
    raise AssertionError("unreachable: each pass gives one read number back or raises")


class _ReadKeys(dict[str, Any]):
    """A config dict that records every top-level key looked up in it (``get``, ``[]``, ``in``,
    ``in .keys()``), present or not: the keys DeepSpeed's parser reads."""

    def __init__(self, data: dict[str, Any], seen: set[str]):
        super().__init__(data)
        self.seen = seen

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def keys(self) -> collections.abc.KeysView[Any]:  # type: ignore[override]
        return collections.abc.KeysView(self)  # its ``in`` asks __contains__


def unread_keys(config: dict[str, Any], world_size: int = 1) -> dict[str, str | None]:
    """The top-level keys of ``config`` (on ``world_size`` ranks, as for
    :func:`validate_deepspeed_config`) that ``DeepSpeedConfig`` never reads, each with the closest
    key it does read (``difflib``), or None: DeepSpeed ignores such a key without a word (its top
    level is not a pydantic model). A few keys are read by ``deepspeed.initialize`` itself, outside
    the parser (``sequence_parallel_size``, ``data_parallel_size``): this is a hint, not a refusal.
    Empty when DeepSpeed refuses ``config`` (:func:`validate_deepspeed_config` says why)."""
    seen: set[str] = set()
    try:
        _config_class()(_ReadKeys(copy.deepcopy(config), seen), world_size)
    except Exception:  # noqa: BLE001 - a refused config is validate_deepspeed_config's to report
        return {}  # the parse stopped early: the keys after the refusal were not looked up
    known = sorted(k for k in seen if isinstance(k, str))
    return {k: next(iter(difflib.get_close_matches(k, known, n=1)), None) for k in config if k not in seen}
