"""ulysses (DeepSpeed-Ulysses): trade the sequence split for a head split and back.

An all-to-all turns each device's [s/c, h] chunk into [s, h/c]: full sequences for a
subset of heads, attended locally; a second all-to-all restores the sequence split. Per
device the traffic stays 4*s*h/c per layer as s and c grow together, but the degree is
capped by the query heads. When there are fewer KV heads than the degree, KV heads are
repeated so that every device gets the ones its query heads use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy
from lctrain.recipes.schema import Recipe, RecipeError


def sequence_to_heads(x, axis_name):
    """[b, s/c, h, d] on each device -> [b, s, h/c, d]."""
    return jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)


def heads_to_sequence(x, axis_name):
    """[b, s, h/c, d] on each device -> [b, s/c, h, d]."""
    return jax.lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)


def repeat_kv_heads_for(degree: int, kv_heads: int, kv: jax.Array) -> jax.Array:
    """Repeats KV heads (GQA-consistently) until `degree` divides their number."""
    repeats = degree // math.gcd(kv_heads, degree)
    return jnp.repeat(kv, repeats, axis=2) if repeats > 1 else kv


def check_ulysses_degree(recipe: Recipe, axis_sizes: dict[str, int], degree: int,
                         key: str) -> None:
    heads_per_shard = recipe.model.n_heads // axis_sizes["tensor"]
    if heads_per_shard % degree:
        raise RecipeError(
            f"recipe key '{key}' = {degree}: Ulysses splits the {heads_per_shard} query heads "
            f"of each tensor shard (model.n_heads / mesh.tensor) over this degree, so it must "
            f"divide them; use a smaller degree, or ring/usp for the rest")


class Ulysses(ContextStrategy):
    name = "ulysses"

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        check_ulysses_degree(recipe, axis_sizes, axis_sizes["context"], "mesh.context")
        super().check(recipe, axis_sizes, platform)

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        return recipe.data.seq_len, recipe.data.seq_len

    def local_attention(self, q, k, v, positions, segment_ids):
        def attend(q, k, v, positions, segment_ids):
            return self.kernel(q, k, v, positions, positions, segment_ids, segment_ids)

        return ulysses_attention(q, k, v, positions, segment_ids, CONTEXT_AXIS, attend)


def ulysses_attention(q, k, v, positions, segment_ids, axis_name, attend_full_sequence):
    """Ulysses over `axis_name`; `attend_full_sequence(q, k, v, positions, segment_ids)`
    does the work for this device's group of heads."""
    degree = jax.lax.axis_size(axis_name)
    k, v = (repeat_kv_heads_for(degree, k.shape[2], x) for x in (k, v))
    q, k, v = (sequence_to_heads(x, axis_name) for x in (q, k, v))
    positions, segment_ids = (jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
                              for x in (positions, segment_ids))
    out = attend_full_sequence(q, k, v, positions, segment_ids)
    return heads_to_sequence(out, axis_name)
