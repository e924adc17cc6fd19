"""A config.json's layer kinds as model.layer_pattern, for the families that mix them
(Gemma 3: sliding and global; Qwen3-Next: linear and global). Pure Python, as hf_config."""

from __future__ import annotations

from pathlib import Path

from .schema import RecipeError


def layer_kinds_from(config: dict, source: Path, kinds: dict[str, str], interval_key: str,
                     interval: int, whose: str) -> list[str]:
    """Each layer's kind, from layer_types (`kinds`: its entries -> ours) or, in older
    configs, every `interval_key`-th layer full_attention and the others the other type."""
    other = next(name for name in kinds if name != "full_attention")
    every = config.get(interval_key, interval)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else other
        for i in range(config["num_hidden_layers"])]
    unknown = [name for name in types if name not in kinds]
    if unknown:
        raise RecipeError(f"{source}: layer_types entry {unknown[0]!r} is not supported; "
                          f"{whose} are {' or '.join(kinds)}")
    return [kinds[name] for name in types]


def pattern_groups(kinds: list[str], extra: dict[str, dict] | None = None) -> list[dict]:
    """model.layer_pattern for the layers' kinds: their shortest repeat, as groups of
    consecutive layers of one kind (with `extra` keys per kind)."""
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(kind == kinds[i % p] for i, kind in enumerate(kinds)))
    groups: list[dict] = []
    for kind in kinds[:period]:
        if groups and groups[-1]["kind"] == kind:
            groups[-1]["count"] += 1
        else:
            groups.append(dict(kind=kind, count=1, **(extra or {}).get(kind, {})))
    return groups
