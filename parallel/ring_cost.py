"""ring's cost model: what K/V travelling around r chips costs one device.

Functions of parallel/cost_model.Dims, written for a ring of dm.r chips that each hold
s/r tokens of h/u query heads, so usp (Ulysses degree u inside, ring across) uses them
too; for ring itself u = 1. The Ring class takes them through classmethods.
"""

from __future__ import annotations

import math

from lctrain.parallel.chips import Chip
from lctrain.parallel.cost_model import (F32, RING_SENDS, TOKEN_IDS, AttentionFootprint, Dims,
                                         RingTiming, Traffic)


def ring_attention_footprint(dm: Dims) -> AttentionFootprint:
    """K, V, ids in flight (current + next), f32 dK, dV, f32 out/dq accumulators and lse,
    q/out/dout in the compute dtype: all of one ring step's chunk. dK/dV count three
    pairs although a step holds one (the kernel adds into the sum that arrived): on the
    grid recompiled after the ring's own chunk went last, a refit with one pair
    (benchmarks/refit_planner.py --fit) fits worse than three (benchmarks/RESULTS.md,
    "Planner accuracy, round by round"). Only programs with the MLP in chunks peak here."""
    d, p = dm.d, dm.p
    heads = dm.h // dm.u
    kv = max(math.lcm(dm.kv, dm.u) // dm.u, 1) if dm.u > 1 else dm.kv
    tokens = dm.s // dm.r
    working_set = dm.b * tokens * (2 * (2 * kv * d * p + TOKEN_IDS) + 3 * 2 * kv * d * F32
                                   + heads * d * (2 * F32 + 3 * p) + heads * F32)
    return AttentionFootprint(working_set, tokens, tokens, heads, kv)


def ring_traffic(dm: Dims) -> Traffic:
    """Forward (and each recomputation): r-1 sends of K, V and the stacked ids (the last
    chunk to arrive goes nowhere). Backward: r-1 sends of K, V, ids and r-1 of the dK/dV
    sum (parallel/ring.DKV_TRANSPORT_DTYPE, f32), which starts one chip on and ends
    home. The ties of every ring step keep each send in its layer (nothing is hoisted)."""
    r, L, passes = dm.r, dm.layers, dm.ring_passes
    chunk = dm.b * (dm.s // r)
    heads = dm.kv // dm.u if dm.kv % dm.u == 0 else max(dm.kv_repeated // dm.u, 1)
    kv = chunk * heads * dm.d * dm.p
    tok = chunk * TOKEN_IDS
    forward = passes * L * (r - 1) * (2 * kv + tok)
    backward = L * (r - 1) * (2 * kv + 2 * kv * F32 / dm.p + tok)
    return {RING_SENDS: ("collective-permute", forward + backward)}


def ring_timing(dm: Dims, chip: Chip) -> RingTiming:
    return RingTiming(_work_over_send(dm, chip), _merge_seconds(dm, chip))


def _work_over_send(dm: Dims, chip: Chip) -> float:
    """One ring step's attention time over its K/V send time (one link). Forward step:
    2 b (s/r) kv d p bytes against 4 b (s/r)^2 (h/u) d / 2 flops (with load balancing half
    of each block pair is causal-masked on average; the backward moves 3x the bytes for
    2.5x the flops)."""
    chunk = dm.b * (dm.s // dm.r)
    send = 2 * chunk * max(dm.kv // dm.u, 1) * dm.d * dm.p / chip.link_bytes_per_s
    work = 2 * chunk * (dm.s // dm.r) * (dm.h // dm.u) * dm.d / chip.peak_bf16_flops
    return work / send


def _merge_seconds(dm: Dims, chip: Chip) -> float:
    """Memory-bound work the ring adds per step: the forward rescales and adds its f32
    output accumulator ([b, s/r, h/u, d], read twice, written once, plus the block's
    output), the backward adds into f32 dq, dK, dV (read and written). At HBM bandwidth."""
    if not chip.hbm_bytes_per_s:
        return 0.0
    chunk = dm.b * (dm.s // dm.r)
    heads, kv = dm.h // dm.u, max(dm.kv // dm.u, 1)
    forward = chunk * heads * dm.d * (3 * F32 + dm.p)
    backward = chunk * (heads + 2 * kv) * dm.d * 2 * F32
    per_layer = dm.r * (dm.ring_passes * forward + backward)
    return dm.accum * dm.layers * per_layer / chip.hbm_bytes_per_s
