"""The recipe reference (a Markdown table) generated from the schema; docs/recipes.md embeds
it once, between START and END, and a test checks that it is current. Rewrite it there with
`python -m lctrain.recipes.reference docs/recipes.md` (no argument: print it)."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

from .schema import MODEL_PRESETS, Recipe

PRESET_KEYS = {f"model.{name}" for name in MODEL_PRESETS["tiny"]}

START = "<!-- recipe-reference:start -->"
END = "<!-- recipe-reference:end -->"


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is dict:
        return f"map name -> {_type_name(args[1])}"
    if origin in (typing.Union, types.UnionType):
        members = " or ".join(_type_name(a) for a in args if a is not type(None))
        return f"{members} or null" if type(None) in args else members
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field, key: str) -> str:
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    if field.default is None:
        return "preset or config.json" if key in PRESET_KEYS else "null"
    return f"`{field.default!r}`"


def _rows(cls: type, prefix: str) -> list[str]:
    """One row per key of `cls`; a nested section (e.g. model.rope_scaling) gets its row,
    then one per key inside it."""
    rows = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, hint = f"{prefix}{field.name}", hints[field.name]
        bare = _without_null(hint)
        section = _section(bare)
        listed = typing.get_origin(bare) is list  # e.g. data.sources: data.sources[].path
        type_name = _type_name(hint)
        if section:
            type_name = "list of sections, below" if listed else "section, below"
        rows.append(f"| `{key}` | {type_name} | {_default(field, key)} | {field.metadata['help']} |")
        if section:
            rows += _rows(section, key + ("[]." if listed else "."))
    return rows


def _without_null(hint):
    """X of `X | None` (e.g. model.layer_pattern's list), else the hint."""
    members = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return members[0] if optional and len(members) == 1 else hint


def _section(hint) -> type | None:
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def recipe_reference() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for section in dataclasses.fields(Recipe):
        rows += _rows(typing.get_type_hints(Recipe)[section.name], section.name + ".")
    return "\n".join([START, *rows, END])


def embedded_reference(text: str) -> str | None:
    """The reference block of a document (START to END), None unless it has exactly one."""
    if text.count(START) != 1 or text.count(END) != 1:
        return None
    return text[text.index(START):text.index(END) + len(END)]


def rewrite(path: Path) -> None:
    """Replaces the document's reference block (START to the last END) with the current one."""
    text = path.read_text()
    start, end = text.index(START), text.rindex(END) + len(END)
    path.write_text(text[:start] + recipe_reference() + text[end:])


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rewrite(Path(sys.argv[1]))
    else:
        print(recipe_reference())
