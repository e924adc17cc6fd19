"""usp (Unified Sequence Parallelism): Ulysses inside a group of chips, ring across groups.

mesh.context = parallel.ulysses x ring degree. The all-to-all runs over the 'ulysses'
mesh axis (put it on the fastest links), so each group holds its part of the sequence
for a subset of heads; ring attention then runs over the 'context' axis between groups.
The Ulysses degree is capped by the heads; the ring takes the rest of the sequence.
"""

from __future__ import annotations

import jax

from lctrain.parallel.chips import Chip
from lctrain.parallel.cost_model import (AttentionFootprint, Dims, NotOnThisMesh, RingTiming,
                                         Traffic)
from lctrain.parallel.ring import kernel_layout, ring_attention, ring_options
from lctrain.parallel.ring_cost import ring_attention_footprint, ring_timing, ring_traffic
from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy
from lctrain.parallel.ulysses import (all_to_all_local_side, check_ulysses_degree,
                                      ulysses_attention, ulysses_degree_limit,
                                      ulysses_traffic)
from lctrain.recipes.schema import Recipe, RecipeError

ULYSSES_AXIS = "ulysses"


class UnifiedSequenceParallel(ContextStrategy):
    name = "usp"
    simplicity = 3
    takes_ulysses_degree = True

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        ulysses, context = recipe.parallel.ulysses, axis_sizes["context"]
        if context % ulysses:
            raise RecipeError(
                f"recipe key 'parallel.ulysses' = {ulysses}: must divide mesh.context "
                f"({context}); the ring degree is mesh.context / parallel.ulysses")
        check_ulysses_degree(recipe, axis_sizes, ulysses, "parallel.ulysses")
        super().check(recipe, axis_sizes, platform)

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        """A ring step between groups: each holds seq_len / ring degree tokens."""
        ring = axis_sizes["context"] // recipe.parallel.ulysses
        return (recipe.data.seq_len // ring,) * 2

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        options = ring_options(self.kernel_options, window)
        # The ring's kernel calls take a Ulysses group's chunk against another's.
        layout = kernel_layout(positions.shape[1] * jax.lax.axis_size(ULYSSES_AXIS),
                               dict(options))

        def ring_over_groups(q, k, v, positions, segment_ids):
            return ring_attention(q, k, v, positions, segment_ids, CONTEXT_AXIS, options,
                                  layout)

        return ulysses_attention(q, k, v, positions, segment_ids, ULYSSES_AXIS,
                                 ring_over_groups, layout)

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        """The largest Ulysses degree the heads allow that still leaves a ring (the whole
        of mesh.context would be ulysses itself)."""
        super().planned_ulysses_degree(recipe, axis_sizes)
        context, limit = axis_sizes["context"], ulysses_degree_limit(recipe, axis_sizes)
        degree = max((u for u in range(2, context) if context % u == 0 and limit % u == 0),
                     default=None)
        if not degree:
            raise NotOnThisMesh("no Ulysses degree between 1 and mesh.context divides the heads")
        return degree

    @classmethod
    def degrees(cls, context: int, ulysses: int) -> tuple[int, int]:
        return ulysses, context // max(ulysses, 1)

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """The ring's, over groups (s/r tokens of h/u heads per ring step), and the local
        side of the all-to-alls around it (llama3.1-8b at 2M tokens on v5p:4x4x4, u = 32:
        the compiled program holds bf16 [1, 32, s_l, 128] q-side and [s_l, 8, 4, 128]
        repeated K/V buffers beside the ring's)."""
        ring = ring_attention_footprint(dm)
        return ring._replace(working_set=ring.working_set + all_to_all_local_side(dm))

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        return {**ulysses_traffic(dm), **ring_traffic(dm)}

    @classmethod
    def ring_timing(cls, dm: Dims, chip: Chip) -> RingTiming:
        return ring_timing(dm, chip)
