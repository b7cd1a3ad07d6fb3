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
field that takes no such number refuses it, naming the fix (``write 500000000 or 5.0e+8``; for
text that is no number, that the field takes a whole number).

Checks of DeepSpeed's own behaviour, without a list of its keys: a top-level section DeepSpeed's
parser reads as a mapping (it looks keys up in an empty one) given another value
(``zero_optimization: true``, DeepSpeed's deprecated ZeRO format) is refused before DeepSpeed
parses it; a top-level key its parser never reads is refused when it is a misspelling
(:data:`MISSPELT`) of a key it reads. DeepSpeed's logger is kept off the console while it parses.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import difflib
import functools
import logging
import re
import reprlib
from collections.abc import Iterator, Mapping
from typing import Any

from smelt_ds.errors import ConfigError
from smelt_ds.mappings import deep_merge

__all__ = ["MISSPELT", "SCIENTIFIC", "DS_CONFIG_DOCS", "read_scientific", "unread_keys", "validate_deepspeed_config"]

_LOG = logging.getLogger(__name__)

#: a number in scientific notation (``5e8``, ``1E-3``, ``2.5e+9``, ``5.0e8``) that YAML 1.1 reads as a string
SCIENTIFIC = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
#: text that looks like a number in scientific notation (``5e8``, ``5e8x``, ``5 E+8``), whole or not
_LOOKS_SCIENTIFIC = re.compile(r"\d\s*[eE]\s*[-+]?\d")
#: the ``difflib`` ratio from which a top-level key DeepSpeed's parser never reads is a misspelling
#: of the key it reads (refused) rather than a key read elsewhere (a warning). One edit in a key of
#: n >= 5 characters scores at least 0.8: a substitution or a swap of two neighbours (n-1)/n >= 4/5,
#: a dropped character 2(n-1)/(2n-1) >= 8/9, an added one 2n/(2n+1) >= 10/11
#: (``zero_optimiztion`` / ``zero_optimization``: 0.97); a different key that shares a word scores
#: less (``data_parallel_size``, read by ``deepspeed.initialize``, / ``tensor_parallel``: 0.61).
MISSPELT = 0.8
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


class _Notices(logging.Handler):
    """The first line of each warning DeepSpeed's logger gives while it parses (:func:`_quiet`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage().strip().splitlines()[0] if record.getMessage().strip() else ""
        if line and line not in self.lines:
            self.lines.append(line)


@contextlib.contextmanager
def _quiet() -> Iterator[list[str]]:
    """DeepSpeed's logger (``DeepSpeed``, which writes to stdout and does not propagate) without
    its handlers inside the block: what it logs (e.g. its ~40-line notice for the deprecated
    ``zero_optimization: true``) is kept, one line per warning, in the list yielded, not printed."""
    ds_log = logging.getLogger("DeepSpeed")
    handlers, notices = ds_log.handlers[:], _Notices()
    ds_log.handlers = [notices]
    try:
        yield notices.lines
    finally:
        ds_log.handlers = handlers


#: the DeepSpeed deprecation notices logged so far (each is logged once per process)
_LOGGED: set[str] = set()


def _deepspeed_error(config: dict[str, Any], world_size: int, log: bool = True) -> Exception | None:
    """What ``DeepSpeedConfig`` raises for ``config`` on ``world_size`` ranks, or None. Every
    exception counts: DeepSpeed refuses a config with pydantic's ValidationError, its own
    DeepSpeedConfigError, asserts, and a TypeError or ValueError for a section of the wrong shape.
    DeepSpeed's log lines are not printed; a deprecation it logs for a config it accepts is logged
    here as one line, once (``log``)."""
    parser = _config_class()
    with _quiet() as notices:
        try:
            parser(copy.deepcopy(config), world_size)
        except Exception as e:  # noqa: BLE001 - whatever DeepSpeed raises is its refusal
            return e
    for line in notices if log else ():
        if "deprecat" in line.lower() and line not in _LOGGED:
            _LOGGED.add(line)
            _LOG.warning("DeepSpeed on the DeepSpeed config of `deepspeed.config`: %s", line)
    return None


class _ReadAsMapping(dict[str, Any]):
    """An empty section that records whether DeepSpeed's parser reads it as a mapping (looks a key
    up, iterates it, unpacks it into a model)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = False

    def _mark(self) -> None:
        self.read = True

    def get(self, key: Any, default: Any = None) -> Any:
        self._mark()
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._mark()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._mark()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        self._mark()
        return super().__iter__()

    def keys(self) -> collections.abc.KeysView[str]:  # type: ignore[override]
        self._mark()
        return super().keys()

    def items(self) -> collections.abc.ItemsView[str, Any]:  # type: ignore[override]
        self._mark()
        return super().items()


def _read_as_mapping(key: str) -> bool:
    """Whether DeepSpeed's parser reads the top-level section ``key`` as a mapping of keys (given
    an empty one beside a batch of one sample)."""
    section = _ReadAsMapping()
    with _quiet(), contextlib.suppress(Exception):  # a refusal of the empty section still read it
        _config_class()({**_ONE_SAMPLE, key: section}, 1)
    return section.read


def _not_a_mapping(path: KeyPath, value: Any, where: str, owned: Mapping[tuple[str, ...], str]) -> str:
    """The message for a section of DeepSpeed's that is given a value that is not a mapping: the
    path, the value, the fix, and the recipe fields that set keys inside that section."""
    inside: dict[str, str] = {}  # field -> the first key it sets in the section
    for p, f in owned.items():
        if len(p) > len(path) and p[:len(path)] == path:
            inside.setdefault(f.split(" (")[0].split(",")[0], ".".join(p[len(path):]))
    fields = f"; the recipe sets {', '.join(f'`{k}` with `{f}`' for f, k in inside.items())}" if inside else ""
    return (f"`{where}.{_dotted(path)}` ({reprlib.repr(value)}, a {type(value).__name__}) must be a mapping of "
            f"DeepSpeed's keys: write its keys under it (e.g. `{where}.{_dotted(path)}.<key>=...`) or remove "
            f"it{fields} (DeepSpeed's keys: {DS_CONFIG_DOCS})")


def _section_error(config: dict[str, Any]) -> tuple[str, Exception] | None:
    """The first top-level key whose section DeepSpeed refuses on its own (beside a batch of one
    sample), and the error; None when each passes alone (the sections clash)."""
    for key, value in config.items():
        if key in _ONE_SAMPLE or key == "train_batch_size":
            continue
        error = _deepspeed_error({**_ONE_SAMPLE, key: value}, 1, log=False)
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
    """The fix for a value DeepSpeed's number field refuses (pydantic's error ``kind``): the hint
    on YAML's reading of ``5e8`` only for text that looks like scientific notation."""
    whole = kind.startswith("int")
    if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()) and not float(value).is_integer():
        return "write a whole number (this field of DeepSpeed's is an integer)"
    if isinstance(value, str) and _LOOKS_SCIENTIFIC.search(value):
        return "write it as a number (YAML reads 5e8 as a string: write 500000000 or 5.0e+8)"
    if isinstance(value, str):
        return ("write a whole number (this field of DeepSpeed's is an integer)" if whole else
                "write a number (this field of DeepSpeed's is a number)")
    return "write a whole number" if kind == "int_from_float" else "write a number"


#: the pydantic errors of a value that is not a mapping where DeepSpeed's model takes one
_MAPPING_ERRORS = ("model_type", "dict_type", "model_attributes_type")


def _refusal(key: str, error: Exception, where: str, config: dict[str, Any],
             owned: Mapping[tuple[str, ...], str]) -> tuple[KeyPath, str]:
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
    if first["type"] in _MAPPING_ERRORS and not isinstance(value, dict):
        return loc, _not_a_mapping(tuple(str(p) for p in loc), value, where, owned)
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
                              where: str = "deepspeed.config",
                              owned: Mapping[tuple[str, ...], str] | None = None) -> dict[str, Any]:
    """Parse ``base`` with ``passthrough`` merged in (:func:`smelt_ds.mappings.deep_merge`) with
    DeepSpeed's ``DeepSpeedConfig`` as ``deepspeed.initialize`` does, on ``world_size`` ranks.

    ``base`` is the rest of the DeepSpeed config (default: a micro-batch of one sample per rank);
    ``world_size`` counts the ranks of the data-parallel world (``train_batch_size`` in ``base``
    must be micro-batch x accumulation x ``world_size``, as DeepSpeed asserts). Numbers in
    scientific notation written as strings (:func:`read_scientific`) are read as numbers,
    except where DeepSpeed's field takes the string. ``owned``: the DeepSpeed key paths a recipe
    field sets, and the field (named when a section holding one is refused). DeepSpeed's own log
    lines are not printed; a deprecation it logs is logged as one line.

    Returns:
        ``passthrough`` with those numbers read (a new dict; the input is not modified).

    Raises:
        ConfigError: DeepSpeed refuses the config. The message names the field path under
            ``where`` (e.g. ``deepspeed.config.zero_optimization.overlap_com``), its value,
            DeepSpeed's own message and the fix: for an unknown key the closest key of the model
            that refused it (``difflib``), for a number the way to write it; for a section of
            DeepSpeed's (a mapping, e.g. ``zero_optimization``) given another value (``true``),
            that it must be a mapping, before DeepSpeed parses it (DeepSpeed would read
            ``zero_optimization: true`` as its deprecated ZeRO format); for a top-level key
            DeepSpeed's parser never reads that is a misspelling (``difflib`` ratio >=
            :data:`MISSPELT`) of a key it reads, the key it reads (:func:`unread_keys`).
    """
    base = {**_ONE_SAMPLE} if base is None else base
    owned = owned or {}
    out, read = read_scientific(passthrough)
    for key, value in deep_merge(base, out).items():
        if not isinstance(value, dict) and _read_as_mapping(key):
            raise ConfigError(_not_a_mapping((key,), value, where, owned))
    for _ in range(len(read) + 1):
        config = deep_merge(base, out)
        error = _deepspeed_error(config, world_size)
        if error is None:
            misspelt = {k: close for k, close in unread_keys(config, world_size, MISSPELT).items() if close}
            if misspelt:
                raise ConfigError("; ".join(
                    f"`{where}.{k}` ({reprlib.repr(config[k])}) is not a key DeepSpeed's config parser reads "
                    f"(DeepSpeed would ignore it and its settings): did you mean `{where}.{close}`? rename it "
                    f"to `{close}`" for k, close in misspelt.items()))
            return out
        found = _section_error(config)
        if found is None:
            raise ConfigError(f"`{where}`: DeepSpeed refuses the DeepSpeed config built from this recipe: "
                              f"{str(error).strip() or type(error).__name__}: fix or remove the keys of {where} it "
                              f"names (DeepSpeed's keys: {DS_CONFIG_DOCS})")
        loc, message = _refusal(*found, where, config, owned)
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


def unread_keys(config: dict[str, Any], world_size: int = 1, cutoff: float = 0.6) -> dict[str, str | None]:
    """The top-level keys of ``config`` (on ``world_size`` ranks, as for
    :func:`validate_deepspeed_config`) that ``DeepSpeedConfig`` never reads, each with the closest
    key it does read (``difflib`` ratio >= ``cutoff``), or None: DeepSpeed ignores such a key
    without a word (its top level is not a pydantic model). A key with a close key at
    :data:`MISSPELT` is refused by :func:`validate_deepspeed_config`. A few keys are read by
    ``deepspeed.initialize`` itself, outside the parser (``sequence_parallel_size``,
    ``data_parallel_size``): for any other key this is a hint, not a refusal.
    Empty when DeepSpeed refuses ``config`` (:func:`validate_deepspeed_config` says why)."""
    seen: set[str] = set()
    parser = _config_class()
    with _quiet():
        try:
            parser(_ReadKeys(copy.deepcopy(config), seen), world_size)
        except Exception:  # noqa: BLE001 - a refused config is validate_deepspeed_config's to report
            return {}  # the parse stopped early: the keys after the refusal were not looked up
    known = sorted(k for k in seen if isinstance(k, str))
    return {k: next(iter(difflib.get_close_matches(k, known, n=1, cutoff=cutoff)), None)
            for k in config if k not in seen}
