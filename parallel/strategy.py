"""The one interface every context-parallel strategy implements.

The model calls `strategy.attend(q, k, v, positions, segment_ids)` with global-shape,
mesh-sharded arrays ([batch, seq, heads, head_dim]); a strategy decides how the sequence
split over the mesh's 'context' axis meets the whole sequence, and calls the attention
kernel from `lctrain.kernels` for the local work.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import numpy as np
from jax.sharding import Mesh

from lctrain.recipes.schema import Recipe


class ContextStrategy:
    name: ClassVar[str]

    def __init__(self, recipe: Recipe, mesh: Mesh):
        self.mesh = mesh
        self.context = mesh.shape["context"]
        self.kernel_options = dict(impl=recipe.attention.impl, block_q=recipe.attention.block_q,
                                   block_kv=recipe.attention.block_kv)
        self.load_balance = recipe.parallel.load_balance and self.context > 1

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> None:
        """Raises RecipeError for combinations this strategy cannot run (before any compile)."""

    def sequence_order(self, seq_len: int) -> np.ndarray | None:
        """Token order the batch is stored in on device; None keeps the natural order.

        With causal attention the last context rank would do most of the work; splitting
        the sequence into 2*context chunks and giving rank i chunks i and 2*context-1-i
        evens it out. Positions and segment ids travel with the tokens, so masks and RoPE
        stay exact and the loss is unchanged.
        """
        if not self.load_balance:
            return None
        return load_balanced_order(seq_len, self.context)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               segment_ids: jax.Array) -> jax.Array:
        raise NotImplementedError


def load_balanced_order(seq_len: int, context: int) -> np.ndarray:
    chunks = np.arange(seq_len).reshape(2 * context, seq_len // (2 * context))
    pairs = [np.concatenate([chunks[i], chunks[2 * context - 1 - i]]) for i in range(context)]
    return np.concatenate(pairs)
