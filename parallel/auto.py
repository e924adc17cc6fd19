"""parallel.strategy=auto: pick a context-parallel strategy from the recipe and the mesh.

A first rule of thumb (the planner refines it): all_gather is the simplest and fastest
while one layer's gathered K/V stay a small share of device memory; beyond that the
sequence must stay split, so Ulysses takes as much of the context degree as the heads
allow and the ring takes the rest (usp), or ring alone when the heads allow no Ulysses.
"""

from __future__ import annotations

import math

from lctrain.recipes.schema import Recipe

# Gathered K/V (and their gradients) of one layer may take this share of device memory.
ALL_GATHER_MEMORY_SHARE = 0.05
BYTES = {"bfloat16": 2, "float32": 4}


def gathered_kv_bytes(recipe: Recipe, axis_sizes: dict[str, int]) -> int:
    """One layer's K and V for the whole sequence on one device, plus their gradients."""
    m = recipe.model
    rows = recipe.data.batch_size // (axis_sizes["data"] * axis_sizes["fsdp"])
    kv_heads = max(m.n_kv_heads // axis_sizes["tensor"], 1)
    return 2 * 2 * rows * recipe.data.seq_len * kv_heads * m.head_dim * BYTES[m.dtype]


def choose_strategy(recipe: Recipe, axis_sizes: dict[str, int],
                    device_memory: int) -> tuple[str, int, str]:
    """Returns (strategy, ulysses degree, the reason in words)."""
    context = axis_sizes["context"]
    if context == 1:
        return "none", 1, "mesh.context is 1"
    kv_bytes = gathered_kv_bytes(recipe, axis_sizes)
    if kv_bytes <= ALL_GATHER_MEMORY_SHARE * device_memory:
        return "all_gather", 1, (
            f"one layer's gathered K/V ({kv_bytes / 2**30:.2f} GiB with gradients) fit in "
            f"{ALL_GATHER_MEMORY_SHARE:.0%} of device memory ({device_memory / 2**30:.0f} GiB)")
    ulysses = math.gcd(recipe.model.n_heads // axis_sizes["tensor"], context)
    too_big = f"gathered K/V ({kv_bytes / 2**30:.2f} GiB per layer) would not fit comfortably"
    if ulysses == context:
        return "ulysses", 1, f"{too_big}; the {context}-way split fits in the heads"
    if ulysses > 1:
        return "usp", ulysses, (f"{too_big}; Ulysses over {ulysses} (as far as the heads "
                                f"allow) x ring over {context // ulysses}")
    return "ring", 1, f"{too_big}; the heads allow no Ulysses split"


def resolve_auto(recipe: Recipe, axis_sizes: dict[str, int], device_memory: int) -> str | None:
    """Replaces strategy 'auto' in the recipe by the chosen one; returns the reason."""
    if recipe.parallel.strategy != "auto":
        return None
    strategy, ulysses, reason = choose_strategy(recipe, axis_sizes, device_memory)
    recipe.parallel.strategy, recipe.parallel.ulysses = strategy, ulysses
    return f"parallel.strategy=auto chose {strategy}: {reason}"
