"""YAML values into the schema's types: sections into dataclasses, scalars checked by type.

Every error is a `RecipeError` naming the key, the value and the type it needed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from .schema import RecipeError

EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def build(cls: type, raw: Any, prefix: str) -> Any:
    """The dataclass `cls` from a mapping of its fields; `prefix` names the section."""
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe key '{prefix.rstrip('.') or '<root>'}' must be a mapping, "
                          f"got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = prefix + unknown[0]
        raise RecipeError(f"unknown recipe key '{key}'; allowed under "
                          f"'{prefix.rstrip('.') or '<root>'}': {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        values[name] = coerce(prefix + name, value, hints[name])
    return cls(**values)


def coerce(key: str, value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        # A mapping only fits a dict member and a scalar only the others (e.g. a strategy
        # name or a map of them): the error is that member's own.
        fitting = [a for a in members if (typing.get_origin(a) is dict) == isinstance(value, dict)]
        return _first_member(key, value, fitting or members)
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"recipe key '{key}': got {value!r}; allowed: "
                              f"{', '.join(map(str, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key + ".")
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"recipe key '{key}': got {value!r}; expected a list")
        return [coerce(f"{key}[{i}]", item, args[0]) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key '{key}': got {value!r}; expected a mapping")
        return {str(k): coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    return _coerce_scalar(key, value, hint)


def _first_member(key: str, value: Any, members: list[Any]) -> Any:
    """`value` as the first member of a union that takes it (e.g. int | Literal["auto"])."""
    if len(members) == 1:
        return coerce(key, value, members[0])
    for member in members:
        try:
            return coerce(key, value, member)
        except RecipeError:
            continue
    raise RecipeError(f"recipe key '{key}': got {value!r} ({type(value).__name__}); expected "
                      f"{' or '.join(map(_expected, members))}")


def _expected(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " or ".join(map(repr, typing.get_args(hint)))
    return EXPECTED.get(hint, getattr(hint, "__name__", str(hint)))


def _coerce_scalar(key: str, value: Any, hint: type) -> Any:
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        try:
            return float(value)  # YAML reads 3e-4 (no dot) as a string
        except (TypeError, ValueError):
            pass
    if hint is str and isinstance(value, str):
        return value
    raise RecipeError(f"recipe key '{key}': got {value!r} ({type(value).__name__}); "
                      f"expected {EXPECTED[hint]}")
