"""The recipe reference (a Markdown table) generated from the schema; the README embeds it
and a test checks that it is current. Regenerate with `python -m lctrain.recipes.reference`."""

from __future__ import annotations

import dataclasses
import typing

from .schema import Recipe

START = "<!-- recipe-reference:start -->"
END = "<!-- recipe-reference:end -->"


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is dict:
        return f"map name -> {_type_name(args[1])}"
    if args and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_name(inner)} or null"
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    return "from preset" if field.default is None else f"`{field.default!r}`"


def recipe_reference() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for section in dataclasses.fields(Recipe):
        section_cls = typing.get_type_hints(Recipe)[section.name]
        hints = typing.get_type_hints(section_cls)
        for field in dataclasses.fields(section_cls):
            rows.append(f"| `{section.name}.{field.name}` | {_type_name(hints[field.name])} | "
                        f"{_default(field)} | {field.metadata['help']} |")
    return "\n".join([START, *rows, END])


if __name__ == "__main__":
    print(recipe_reference())
