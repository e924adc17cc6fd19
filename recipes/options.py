"""What every recipe section is built from: the field helper and the error type.

Apart from schema.py so the model section (model_schema.py) can use them without a
circular import; schema.py re-exports them.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


class RecipeError(ValueError):
    """A recipe value that cannot work; the message names the key, the value and the fix."""


def require(ok: bool, key: str, value: Any, fix: str) -> None:
    """RecipeError naming `key`, its `value` and the `fix`, unless `ok`."""
    if not ok:
        raise RecipeError(f"recipe key '{key}' = {value!r}: {fix}")


def option(default: Any, help: str) -> Any:
    """A recipe field with its one-line documentation (docs/recipes.md's reference)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
