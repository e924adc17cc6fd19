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

from lctrain import kernels
from lctrain.kernels.layout import TOKENS_MAJOR, axes, relayout
from lctrain.parallel.cost_model import (F32, TOKEN_IDS, AttentionFootprint, Dims,
                                         NotOnThisMesh, Traffic)
from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy
from lctrain.recipes.schema import Recipe, RecipeError


def sequence_to_heads(x, axis_name, layout):
    """[b, s/c, h, d] on each device -> [b, s, h/c, d] (or head-major alike)."""
    seq, heads = axes(layout)
    return jax.lax.all_to_all(x, axis_name, split_axis=heads, concat_axis=seq, tiled=True)


def heads_to_sequence(x, axis_name, layout):
    """[b, s, h/c, d] on each device -> [b, s/c, h, d] (or head-major alike)."""
    seq, heads = axes(layout)
    return jax.lax.all_to_all(x, axis_name, split_axis=seq, concat_axis=heads, tiled=True)


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


def ulysses_degree_limit(recipe: Recipe, axis_sizes: dict[str, int]) -> int:
    """Largest Ulysses degree dividing both the query heads per tensor shard and
    mesh.context (check_ulysses_degree)."""
    return math.gcd(recipe.model.n_heads // axis_sizes["tensor"], axis_sizes["context"])


class Ulysses(ContextStrategy):
    name = "ulysses"
    simplicity = 2

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        check_ulysses_degree(recipe, axis_sizes, axis_sizes["context"], "mesh.context")
        super().check(recipe, axis_sizes, platform)

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        return recipe.data.seq_len, recipe.data.seq_len

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        seq_len = positions.shape[1] * jax.lax.axis_size(CONTEXT_AXIS)
        layout = kernels.native_layout(seq_len, seq_len, window=window, **self.kernel_options)

        def attend(q, k, v, positions, segment_ids):
            return self.kernel(q, k, v, positions, positions, segment_ids, segment_ids,
                               layout=layout, window=window)

        return ulysses_attention(q, k, v, positions, segment_ids, CONTEXT_AXIS, attend, layout)

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        degree = super().planned_ulysses_degree(recipe, axis_sizes)
        context = axis_sizes["context"]
        if ulysses_degree_limit(recipe, axis_sizes) != context:
            heads = recipe.model.n_heads // axis_sizes["tensor"]
            raise NotOnThisMesh(f"the {heads} query heads per tensor shard do not split "
                                f"{context} ways")
        return degree

    @classmethod
    def degrees(cls, context: int, ulysses: int) -> tuple[int, int]:
        return context, 1

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """The whole sequence for h/u heads: q, out, dout (compute dtype) and f32 dq; k, v
        (KV heads repeated up to the degree) and their f32 gradients."""
        b, s, d, p = dm.b, dm.s, dm.d, dm.p
        heads = dm.h // dm.u
        kv = max(math.lcm(dm.kv, dm.u) // dm.u, 1)
        working_set = b * s * (heads * d * (3 * p + F32) + 2 * kv * d * (p + F32) + TOKEN_IDS)
        return AttentionFootprint(working_set, s, s, heads, kv)

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        return ulysses_traffic(dm)


def all_to_all_local_side(dm: Dims) -> float:
    """The all-to-alls' local side: the device's own tokens for all its heads, q, out,
    dout (compute dtype) and f32 dq; k, v (KV heads repeated up to the degree: at u = 32
    and 8 KV heads, 4x their size) and their f32 gradients."""
    return dm.b * dm.s_l * dm.d * (dm.h * (3 * dm.p + F32) + 2 * dm.kv_repeated * (dm.p + F32))


def ulysses_traffic(dm: Dims) -> Traffic:
    """The all-to-alls over the Ulysses degree dm.u: q, k, v, out per forward pass (a
    recomputation under remat.policy=minimal keeps `context`, so it skips out's way back),
    dout, dq, dk, dv in the backward; positions and segment ids gathered over the group
    per forward pass (the first forward's once per step: XLA hoists them out of the
    layers, unless the kinds are switched)."""
    b, s_l, d, p, L, u = dm.b, dm.s_l, dm.d, dm.p, dm.layers, dm.u
    passes = dm.attention_passes
    q_local = b * s_l * dm.h * d * p
    kv_local = b * s_l * dm.kv_repeated * d * p
    recompute_out = 0 if dm.remat == "minimal" else 1
    per_layer = (2 * q_local + 2 * kv_local) * 2 \
        + (passes - 1) * (q_local * (1 + recompute_out) + 2 * kv_local)
    id_gathers = passes * L if dm.kinds_switched else (passes - 1) * L + 1
    return {"strategy_all_to_all": ("all-to-all", L * per_layer * (u - 1) / u),
            "strategy_ids": ("all-gather", id_gathers * b * s_l * u * TOKEN_IDS
                             * (u - 1) / u)}


def ulysses_attention(q, k, v, positions, segment_ids, axis_name, attend_full_sequence,
                      layout):
    """Ulysses over `axis_name`; `attend_full_sequence(q, k, v, positions, segment_ids)`
    does the work for this device's group of heads, on tensors in `layout` (its kernel's:
    the all-to-alls then deliver what the kernel reads, and no copy relayouts it)."""
    degree = jax.lax.axis_size(axis_name)
    k, v = (repeat_kv_heads_for(degree, k.shape[2], x) for x in (k, v))
    q, k, v = (sequence_to_heads(relayout(x, TOKENS_MAJOR, layout), axis_name, layout)
               for x in (q, k, v))
    positions, segment_ids = (jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
                              for x in (positions, segment_ids))
    out = attend_full_sequence(q, k, v, positions, segment_ids)
    return relayout(heads_to_sequence(out, axis_name, layout), layout, TOKENS_MAJOR)
