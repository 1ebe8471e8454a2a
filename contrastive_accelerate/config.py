"""Options declared once, on a dataclass; the command line and config files follow from it.

Each field of the config dataclass is declared with ``option(default, help, ...)``:
its type comes from the annotation, its choices and bounds from the call. From that
one declaration come the ``--flag`` (``parser``), the YAML/JSON config file's key
(``load_file``), validation (``validate``, which the dataclass calls in
``__post_init__``, so a config built in Python is checked exactly as the CLI's is)
and the field's rule on resume (``resume``: may a checkpoint continue with a new
value?). No library earns its place for this: ``HfArgumentParser`` would bring in
transformers, and jsonargparse / tyro / simple-parsing each add a dependency and a
second vocabulary for what ~150 lines of argparse state plainly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from contrastive_accelerate.untrusted import parse_json, parse_yaml, preview

#: Resume rules: "refuse" - a different value on resume is an error (it changes the data,
#: the model or what the saved state means); "apply" - the new value is used and said;
#: "free" - does not shape the optimisation (logging, paths, workers).
RESUME_RULES = ("refuse", "apply", "free")


class ConfigError(ValueError):
    """An invalid option value: reported as one line naming the option."""


def field_names(section) -> tuple[str, ...]:
    """The names of a dataclass's fields (an options section's), in order."""
    return tuple(field.name for field in dataclasses.fields(section))


def option(
    default: Any,
    help: str,
    *,
    resume: str = "refuse",
    choices: Sequence[Any] | Mapping[Any, Any] | None = None,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
) -> Any:
    """A dataclass field carrying everything the CLI, config files and validation need.

    ``resume`` is "refuse" unless the option may change when a checkpoint is continued.
    ``choices`` a table (a mapping): its keys, as the table has them when an option is
    checked, so that a row added to it is a choice."""
    if resume not in RESUME_RULES:
        raise ValueError(f"resume must be one of {RESUME_RULES}")
    metadata = {
        "help": help,
        "resume": resume,
        "choices": choices if isinstance(choices, Mapping) else tuple(choices or ()) or None,
        "bounds": (at_least, above, below, at_most),
    }
    return dataclasses.field(default=default, metadata=metadata)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def is_set(config: Any, name: str) -> bool:
    """Whether ``config``'s field ``name`` holds another value than its declared default."""
    field = next(field for field in dataclasses.fields(config) if field.name == name)
    return getattr(config, name) != field.default


def _field_types(cls) -> dict[str, tuple[type, bool]]:
    """``{name: (base type, accepts None)}`` for every field of ``cls``; a field typed
    ``str | tuple[str, ...]`` is a ``str`` that may be given several times (``repeated``)."""
    hints = typing.get_type_hints(cls)
    result = {}
    for field in dataclasses.fields(cls):
        hint, optional = hints[field.name], False
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            optional = len(members) < len(typing.get_args(hint))
            if members == [str, tuple[str, ...]]:
                members = [str]
            if len(members) != 1:
                raise TypeError(f"{cls.__name__}.{field.name}: unsupported type {hint}")
            hint = members[0]
        if hint not in (bool, int, float, str):
            raise TypeError(f"{cls.__name__}.{field.name}: unsupported type {hint}")
        result[field.name] = (hint, optional)
    return result


def repeated(cls) -> set[str]:
    """The fields of ``cls`` that may be given several times (``str | tuple[str, ...]``):
    one value is a ``str``, several a tuple of them."""
    hints = typing.get_type_hints(cls)
    return {field.name for field in dataclasses.fields(cls)
            if tuple[str, ...] in typing.get_args(hints[field.name])}  # fmt: skip


def _coerce(name: str, value: Any, kind: type, optional: bool, several: bool = False) -> Any:
    """``value`` as ``kind``, converting only where no information is lost; ``several``:
    a list of them too, one value as itself."""
    if several and isinstance(value, list | tuple):
        if not value:
            raise ConfigError(f"{flag(name)}: an empty list")
        values = tuple(_coerce(name, item, kind, False) for item in value)
        return values[0] if len(values) == 1 else values
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{flag(name)}: a value is required")
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise ConfigError(f"{flag(name)}: expected {kind.__name__}, got {preview(value)}")


def validate(config: Any) -> None:
    """Check and normalise every field of ``config`` in place; raises ``ConfigError``."""
    field_types, several = _field_types(type(config)), repeated(type(config))
    for field in dataclasses.fields(config):
        kind, optional = field_types[field.name]
        value = _coerce(
            field.name, getattr(config, field.name), kind, optional, field.name in several
        )
        object.__setattr__(config, field.name, value)
        if value is None:
            continue
        choices = field.metadata["choices"]
        if choices and value not in choices:
            options = ", ".join(map(str, choices))
            raise ConfigError(f"{flag(field.name)} {preview(value)}: choose one of {options}")
        if kind in (int, float):
            _check_bounds(field.name, value, *field.metadata["bounds"])


#: Every number a float option holds meets float32 tensors (the optimizer turns --lr and
#: --weight-decay into the weights' dtype): beyond this it is an overflow, not a value.
FLOAT32_MAX = 3.4028234663852886e38


def _check_bounds(name, value, at_least, above, below, at_most) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{flag(name)} {value}: must be a finite number")
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        raise ConfigError(f"{flag(name)} {value:g}: must be within float32's range (3.4e+38)")
    rules = [(at_least, ">="), (above, ">"), (below, "<"), (at_most, "<=")]
    rules = [(limit, relation) for limit, relation in rules if limit is not None]
    holds = {
        ">=": lambda limit: value >= limit,
        ">": lambda limit: value > limit,
        "<": lambda limit: value < limit,
        "<=": lambda limit: value <= limit,
    }
    if not all(holds[relation](limit) for limit, relation in rules):
        wanted = " and ".join(f"{relation} {limit:g}" for limit, relation in rules)
        raise ConfigError(f"{flag(name)} {value:g}: must be {wanted}")


def resume_rules(cls) -> dict[str, str]:
    return {field.name: field.metadata["resume"] for field in dataclasses.fields(cls)}


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one ``error:`` line (every rank prints its own), exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"error: {message} (see --help)\n".encode())
        sys.exit(2)


def _parse_value(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def parser(cls, description: str) -> argparse.ArgumentParser:
    """An argument parser with one flag per field of ``cls``, plus ``--config FILE``.

    Flags that are not given stay absent from the parsed namespace (``SUPPRESS``), so
    that a config file fills them and a flag on the command line overrides the file.
    """
    result = OneLineParser(description=description, argument_default=argparse.SUPPRESS)
    result.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON file of options (keys as below, with - or _); flags override it",
    )
    field_types, several = _field_types(cls), repeated(cls)
    own = vars(cls).get("__annotations__", {})  # listed first: a dataclass puts its bases' first
    for field in sorted(dataclasses.fields(cls), key=lambda field: field.name not in own):
        kind, optional = field_types[field.name]
        default = "none" if field.default is None else field.default
        # argparse %-formats help strings
        help_text = f"{field.metadata['help']} (default: {default})".replace("%", "%%")
        if kind is bool:
            result.add_argument(
                flag(field.name), action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        result.add_argument(
            flag(field.name),
            action="append" if field.name in several else "store",
            type=_parse_value(kind, optional),
            choices=field.metadata["choices"],
            metavar=None if field.metadata["choices"] else kind.__name__.upper(),
            help=help_text,
        )
    return result


def load_file(cls, path: str) -> dict[str, Any]:
    """The options in a YAML or JSON file, keyed by field name; unknown keys are an error."""
    try:
        with open(path) as file:
            text = file.read()
    except OSError as error:
        raise ConfigError(f"--config {path!r}: {error.strerror or error}") from None
    try:
        values = parse_json(text) if path.endswith(".json") else parse_yaml(text)
    except ValueError as error:
        raise ConfigError(f"--config {path!r}: not valid YAML/JSON: {error}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path!r}: expected a mapping of options")
    names = {field.name for field in dataclasses.fields(cls)}
    normalised = {str(key).replace("-", "_"): value for key, value in values.items()}
    unknown = sorted(set(normalised) - names)
    if unknown:
        raise ConfigError(f"--config {path!r}: unknown option(s) {', '.join(unknown)}")
    return normalised


def parse_args(cls, argv: Sequence[str] | None = None, description: str = "") -> Any:
    """Build ``cls`` from ``--config FILE`` (if any) and the flags, the flags winning."""
    namespace = vars(parser(cls, description).parse_args(argv))
    config_file = namespace.pop("config", None)
    values = load_file(cls, config_file) if config_file else {}
    values.update(namespace)
    return cls(**values)
