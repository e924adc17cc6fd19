"""halo: sliding-window layers with context parallelism by a neighbour's last window-1 tokens.

A query at position p sees keys p-w+1 .. p (window w, kernels/masks.py). So a device
holding a chunk of the sequence needs, beyond its own K/V, only the last w-1 tokens of
the chunk before it: one lax.ppermute over the context axes (the sequence shards, in
order), of K, V and their positions and segment ids. With load balancing (rank i holds
chunks i and 2c-1-i) there are two: chunk i's predecessor is rank i-1's first chunk,
chunk 2c-1-i's is rank i+1's second (rank c-1's second chunk follows its own first, which
it holds). Each device then attends its queries to [halo(s), own chunk(s)] with the
window; the mask comes from positions alone, so nothing else is needed. Autodiff turns
each send into the reverse send of the halo's dK/dV.

Traffic per layer: (w-1) tokens of K and V (+ ids) per exchange, whatever the sequence
length; memory: the chunk plus the halo. Needs w-1 <= the chunk (else the keys a query
needs span more than one neighbour: use more tokens per chip, a smaller window, or ring).

The permutations are cyclic: the first rank receives the last rank's tail and the last
the first's, keys that lie outside every window of their receiver (or in its causal
future), so the mask drops them and the Pallas kernel skips their blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lctrain.parallel.cost_model import (F32, TOKEN_IDS, AttentionFootprint, Dims,
                                         NotOnThisMesh, Traffic)
from lctrain.parallel.sharding import LOGICAL_TO_MESH
from lctrain.parallel.strategy import ContextStrategy, query_residuals, stored_chunk_tokens
from lctrain.recipes.schema import Recipe, RecipeError

# The sequence's shards in sequence order (context major, ulysses minor): the neighbours.
SEQUENCE_AXES = LOGICAL_TO_MESH["sequence"]
# A halo is padded on arrival (not on the wire) to a multiple of up to this many tokens,
# so [halo, chunk] still tiles in the kernels' blocks (TPU: multiples of 128).
PAD_MULTIPLE = 128
# Padding tokens: a segment no document has (they start at 1) and a position outside
# every window, so no query sees them and whole padding blocks are skipped.
PAD_SEGMENT = -1
PAD_POSITION = -2**30
# Exchanges the planner assumes (parallel.load_balance defaults to true; Dims has no flag).
PLANNED_EXCHANGES = 2


def check_halo_window(window: int, chunk_tokens: int) -> None:
    """ValueError unless the window's w-1 earlier keys fit in one neighbouring chunk."""
    if window - 1 > chunk_tokens:
        raise ValueError(
            f"halo attention with window {window} needs window - 1 <= the {chunk_tokens} "
            f"tokens of each stored chunk; use more tokens per chip (data.seq_len / "
            f"mesh.context), a window of at most {chunk_tokens + 1}, or strategy ring")


class Halo(ContextStrategy):
    name = "halo"
    simplicity = 5

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        """RecipeError unless the sliding layers' window - 1 fits in one stored chunk."""
        window = recipe.model.layer_group("sliding").window
        if window is not None:
            try:
                check_halo_window(window, stored_chunk_tokens(recipe, axis_sizes["context"]))
            except ValueError as err:
                index = next(i for i, group in enumerate(recipe.model.layer_pattern)
                             if group.kind == "sliding")
                raise RecipeError(f"recipe key 'model.layer_pattern[{index}].window' = "
                                  f"{window}: {err}") from None
        super().check(recipe, axis_sizes, platform)

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        """Not a whole model's strategy: global layers need keys from every chip."""
        raise NotOnThisMesh("halo serves sliding-window layers only")

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        """The chunk against itself (the halo is padded to the chunk's tiling)."""
        return (recipe.data.seq_len // axis_sizes["context"],) * 2

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """The local queries against [halo, chunk]: K, V (+ ids) and their f32
        gradients, q, out, dout (compute dtype) and f32 dq."""
        kv_tokens = dm.s_l + halo_tokens(dm)
        working_set = (dm.b * kv_tokens * (2 * dm.kv * dm.d * (dm.p + F32) + TOKEN_IDS)
                       + dm.b * dm.s_l * dm.h * dm.d * (3 * dm.p + F32))
        return AttentionFootprint(working_set, dm.s_l, kv_tokens, dm.h, dm.kv)

    @classmethod
    def kernel_residuals(cls, dm: Dims) -> float:
        return query_residuals(dm) + 2 * dm.b * (dm.s_l + halo_tokens(dm)) * dm.kv * dm.d * dm.p

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        """Per layer and forward pass (first and recomputed) (w-1) tokens of K and V per
        exchange; in the backward the halo's dK, dV go back (compute dtype). The ids
        (positions, segment ids) are the same in every layer: XLA sends them once per step,
        or per layer and forward pass where the layers' kinds are switched (compiled whole
        steps, tests/test_planner_kinds.py)."""
        kv = 2 * dm.kv * dm.d * dm.p
        tokens = dm.b * halo_tokens(dm)
        id_sends = dm.layers * dm.attention_passes if dm.kinds_switched else 1
        return {"strategy_halo": ("collective-permute", tokens * (
            dm.layers * (dm.attention_passes + 1) * kv + id_sends * TOKEN_IDS))}

    def attend(self, q, k, v, positions, segment_ids, *, window=None):
        if window is None:
            raise ValueError("halo serves sliding-window layers only (window=None); use "
                             "another strategy for global attention layers")
        return super().attend(q, k, v, positions, segment_ids, window=window)

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        kv_ids = (k, v, positions, segment_ids)
        if jax.lax.axis_size(SEQUENCE_AXES) > 1:
            kv_ids = with_halos(kv_ids, window, self.load_balance)
        return self.kernel(q, kv_ids[0], kv_ids[1], positions, kv_ids[2], segment_ids,
                           kv_ids[3], window=window)


def halo_tokens(dm: Dims) -> int:
    """Halo tokens one device receives per layer and forward pass (the planner's)."""
    return PLANNED_EXCHANGES * (dm.window - 1) if dm.window else 0


def with_halos(kv_ids, window, load_balance):
    """(k, v, positions, segment ids) of this device preceded by the halo(s) it receives:
    the last window-1 tokens of each of its chunks' predecessors (module docstring)."""
    chunks = 2 if load_balance else 1
    chunk = kv_ids[2].shape[1] // chunks
    check_halo_window(window, chunk)
    width = window - 1
    if width == 0:
        return kv_ids
    size = jax.lax.axis_size(SEQUENCE_AXES)
    to_next = [(i, (i + 1) % size) for i in range(size)]
    halos = [_received(kv_ids, chunk - width, width, to_next)]
    if load_balance:
        to_previous = [(i, (i - 1) % size) for i in range(size)]
        halos.append(_received(kv_ids, 2 * chunk - width, width, to_previous))
    pad = -width % math.gcd(chunk, PAD_MULTIPLE)
    return tuple(jnp.concatenate([*(_padded(h[n], pad, n) for h in halos), kv_ids[n]], axis=1)
                 for n in range(4))


def _received(kv_ids, start, width, perm):
    """Tokens [start, start + width) of every device's (k, v, positions, segment ids),
    sent along `perm`: K and V in one array, the ids in another."""
    k, v, positions, segment_ids = (jax.lax.slice_in_dim(x, start, start + width, axis=1)
                                    for x in kv_ids)
    kv = jax.lax.ppermute(jnp.stack([k, v]), SEQUENCE_AXES, perm)
    ids = jax.lax.ppermute(jnp.stack([positions, segment_ids]), SEQUENCE_AXES, perm)
    return kv[0], kv[1], ids[0], ids[1]


def _padded(x, pad, field):
    """x preceded by `pad` padding tokens (zeros for k, v; PAD_POSITION, PAD_SEGMENT)."""
    if pad == 0:
        return x
    value = (0, 0, PAD_POSITION, PAD_SEGMENT)[field]
    return jnp.concatenate([jnp.full((x.shape[0], pad, *x.shape[2:]), value, x.dtype), x],
                           axis=1)
