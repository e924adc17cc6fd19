"""all_gather: every device keeps its chunk of queries and gathers all keys and values.

Per layer each device receives (context-1)/context of the sequence's K and V; autodiff
turns the gather into a reduce-scatter of dK and dV in the backward pass. Simple and
fast while the gathered K/V fit in memory; beyond that use ring or usp.
"""

from __future__ import annotations

import jax

from lctrain.parallel.cost_model import F32, TOKEN_IDS, AttentionFootprint, Dims, Traffic
from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy, query_residuals

# XLA lowers the reduce-scatter of dK + dV as one up to this many bytes per layer, and as
# an all-reduce (twice the bytes) beyond (observed: 17 MB reduce-scattered, 67 MB mixed,
# 537 MB all-reduced).
DKV_REDUCE_SCATTER_LIMIT = 32 * 2**20


def gather_sequence(x):
    return jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)


class AllGather(ContextStrategy):
    name = "all_gather"
    simplicity = 1

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        return self.kernel(q, gather_sequence(k), gather_sequence(v), positions,
                           gather_sequence(positions), segment_ids, gather_sequence(segment_ids),
                           window=window)

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        return gathered_attention_footprint(dm)

    @classmethod
    def kernel_residuals(cls, dm: Dims) -> float:
        return query_residuals(dm) + 2 * dm.b * dm.s * dm.kv * dm.d * dm.p   # gathered K, V

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        """K, V (+ positions, segment ids) gathered per layer in the forward and in each
        recomputation of it (the first forward's id gathers do not depend on the layer:
        XLA hoists them, once per step, unless the kinds are switched); dK, dV
        reduce-scattered once."""
        b, s, d, p, L, passes = dm.b, dm.s, dm.d, dm.p, dm.layers, dm.attention_passes
        share = (dm.c - 1) / dm.c
        kv_full = b * s * dm.kv * d * p
        id_gathers = passes * L if dm.kinds_switched else (passes - 1) * L + 1
        out: Traffic = {"strategy_kv": ("all-gather", (passes * L * 2 * kv_full
                                                       + id_gathers * b * s * TOKEN_IDS)
                                        * share)}
        dkv = 2 * b * s * dm.kv * d * p
        if dkv <= DKV_REDUCE_SCATTER_LIMIT:
            out["strategy_dkv"] = ("reduce-scatter", L * dkv / dm.c * (dm.c - 1))
        else:
            out["strategy_dkv"] = ("all-reduce", L * dkv * 2 * (dm.c - 1) / dm.c)
        return out


def gathered_attention_footprint(dm: Dims) -> AttentionFootprint:
    """Local queries against the whole sequence: the gathered K, V (+ ids) and their f32
    gradients before the reduce-scatter; the local q, out, dout (compute dtype) and f32
    dq."""
    b, d, p = dm.b, dm.d, dm.p
    working_set = (b * dm.s * (2 * dm.kv * d * (p + F32) + TOKEN_IDS)
                   + b * dm.s_l * dm.h * d * (3 * p + F32))
    return AttentionFootprint(working_set, dm.s_l, dm.s, dm.h, dm.kv)
