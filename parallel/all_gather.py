"""all_gather: every device keeps its chunk of queries and gathers all keys and values.

Per layer each device receives (context-1)/context of the sequence's K and V; autodiff
turns the gather into a reduce-scatter of dK and dV in the backward pass. Simple and
fast while the gathered K/V fit in memory; beyond that use ring or usp.
"""

from __future__ import annotations

import jax

from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy


def gather_sequence(x):
    return jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)


class AllGather(ContextStrategy):
    name = "all_gather"

    def local_attention(self, q, k, v, positions, segment_ids):
        return self.kernel(q, gather_sequence(k), gather_sequence(v), positions,
                           gather_sequence(positions), segment_ids, gather_sequence(segment_ids))
