"""The Pallas kernels' structure (kernels/pallas.py), checked without running them: which
blocks the TPU pipeline copies into VMEM, and how many matmuls a block pair costs
(counted by kernels/pallas_structure.py, whose docstring says how).

Copies: the count must equal one per computed step less the steps that reuse the block
already in VMEM, and every visible block pair must be computed once per query head.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels.pallas_schedule import pair_visibility
from lctrain.kernels.pallas_structure import (copy_figures, kv_copy_figures,
                                              matmuls_per_block_pair, schedule, walk)
from lctrain.parallel import halo
from lctrain.parallel.strategy import load_balanced_order

BLOCK = 32
HQ, HKV = 4, 2  # GQA: two query heads share each kv head


def _packed_segments(s, n_docs, seed, restart_positions):
    """(positions, segment ids) [1, s] of n_docs documents in sequence order; positions
    restart per document, or are the sequence index (as the context strategies pass)."""
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(np.arange(1, s), n_docs - 1, replace=False))
    seg = np.searchsorted(starts, np.arange(s), side="right")
    pos = np.arange(s) - np.concatenate([[0], starts])[seg] if restart_positions else np.arange(s)
    return pos[None].astype(np.int32), seg[None].astype(np.int32)


def _load_balanced(context, s, rank, packed):
    """Sequence index and segment id of every stored token of `rank` (its chunks rank and
    2 * context - 1 - rank, of a sequence of s tokens), or of all ranks (rank None)."""
    order = load_balanced_order(s, context)
    _, seg = _packed_segments(s, 5, 7, False) if packed else (None, np.zeros((1, s), np.int32))
    local = slice(None) if rank is None else slice(rank * s // context, (rank + 1) * s // context)
    return order[None, local].astype(np.int32), seg[:, order][:, local]


def _layout(case):
    """(q positions, kv positions, q segment ids, kv segment ids, causal) of a case."""
    s = 512
    one = np.zeros((1, s), np.int32)
    if case == "causal":
        pos = np.arange(s, dtype=np.int32)[None]
        return pos, pos, one, one, True
    if case == "full":
        pos = np.arange(s, dtype=np.int32)[None]
        return pos, pos, one, one, False
    if case == "packed":
        pos, seg = _packed_segments(s, 4, 3, restart_positions=True)
        return pos, pos, seg, seg, True
    if case == "ring_earlier_chunk":  # q chunk 2 of 4, kv chunk 1: all visible
        return np.arange(2 * s, 3 * s)[None], np.arange(s, 2 * s)[None], one, one, True
    if case == "ring_diagonal":  # the same chunk, offset: causal
        pos = np.arange(2 * s, 3 * s, dtype=np.int32)[None]
        return pos, pos, one, one, True
    if case == "load_balanced_local":  # rank 1 of 2: chunks 1 and 2 of 4
        pos, seg = _load_balanced(2, 2 * s, 1, packed=True)
        return pos, pos, seg, seg, True
    if case == "load_balanced_ring_step":  # rank 1's queries, rank 0's keys (chunks 0, 3)
        q_pos, q_seg = _load_balanced(2, 2 * s, 1, packed=False)
        kv_pos, kv_seg = _load_balanced(2, 2 * s, 0, packed=False)
        return q_pos, kv_pos, q_seg, kv_seg, True
    if case == "load_balanced_gathered":  # all_gather: rank 0's queries, all stored keys
        q_pos, q_seg = _load_balanced(4, 4 * s, 0, packed=True)
        kv_pos, kv_seg = _load_balanced(4, 4 * s, None, packed=True)
        return q_pos, kv_pos, q_seg, kv_seg, True
    if case == "window":  # packed documents, sequence indices
        pos, seg = _packed_segments(s, 4, 3, restart_positions=False)
        return pos, pos, seg, seg, True
    if case == "window_load_balanced_gathered":
        return _layout("load_balanced_gathered")[:5]
    if case == "window_halo":  # halo: chunk 1's keys are its padded halo, then itself
        pad = -(WINDOW - 1) % BLOCK
        kv_pos = np.r_[[halo.PAD_POSITION] * pad, np.arange(s - WINDOW + 1, 2 * s)][None]
        kv_seg = np.r_[[halo.PAD_SEGMENT] * pad, np.zeros(WINDOW - 1 + s)][None]
        return kv_pos[:, -s:], kv_pos, one, kv_seg.astype(np.int32), True
    raise ValueError(case)


# Sliding window (kernels/masks.py) of 100 tokens: not a multiple of the 32-token blocks.
WINDOW = 100
WINDOW_CASES = ["window", "window_load_balanced_gathered", "window_halo"]
CASES = ["causal", "full", "packed", "ring_earlier_chunk", "ring_diagonal",
         "load_balanced_local", "load_balanced_ring_step", "load_balanced_gathered",
         *WINDOW_CASES]


def _schedule(case):
    window = WINDOW if case in WINDOW_CASES else None
    return schedule(*_layout(case), heads=HQ, kv_heads=HKV, block=BLOCK, window=window)


def _visible_pairs(pb, prefetch, causal, window):
    some, _ = pair_visibility(prefetch.q_bounds, prefetch.kv_bounds, 0,
                              jnp.arange(pb.nq)[:, None], jnp.arange(pb.nkv)[None, :],
                              pb.nq, pb.nkv, causal, window)
    return np.asarray(some)


@pytest.mark.parametrize("grid_kind", ["query_major", "key_major"])
@pytest.mark.parametrize("case", CASES)
def test_skipped_blocks_are_not_copied(case, grid_kind):
    """Over the forward's grid (k, v, kv id rows) or the backward's (q, dout, lse,
    delta, q id rows): copies == computed steps - reuses, for every operand; each
    visible (q block, kv block) pair is computed exactly once per query head. (The
    backward's dq blocks move by manual DMA, once each way per computed step.)"""
    sched = _schedule(case)
    ids, step, computed, specs = walk(sched, grid_kind)

    visible = _visible_pairs(*sched)
    for head in range(HQ):
        mine = computed & (np.asarray(step.q_head) == head)
        pairs = list(zip(np.asarray(step.q_block)[mine], np.asarray(step.kv_block)[mine]))
        assert len(pairs) == len(set(pairs)) == visible.sum()
        assert all(visible[i, j] for i, j in pairs)

    operands = ((specs.kv, specs.kv_row) if grid_kind == "query_major"
                else (specs.q, specs.stat_row, specs.q_row))
    for spec in operands:
        figures = copy_figures(spec, ids, sched.prefetch, computed)
        assert figures.copies == figures.computed - figures.reuses, figures


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_window_computes_and_copies_only_the_band(case):
    """With window 100 in 32-blocks a q block computes at most ceil(100 / 32) + 1 = 5
    kv blocks (the band behind its diagonal), against up to every earlier block without
    the window; the forward copies K (and V) once per computed pair, less reuses."""
    sched = _schedule(case)
    band = -(-WINDOW // BLOCK) + 1
    per_q_block = _visible_pairs(*sched).sum(axis=1)
    unwindowed = _visible_pairs(*sched._replace(window=None)).sum(axis=1)
    assert per_q_block.max() <= band < unwindowed.max()
    figures = kv_copy_figures(sched)
    assert figures.computed == HQ * per_q_block.sum()
    assert figures.copies == figures.computed - figures.reuses, figures


def test_backward_matmuls_per_block_pair():
    """From the traced VJP's kernel bodies: the fused backward computes one (q block,
    kv block) pair with 5 matmuls (sT = k q^T, dpT = v do^T, dv += pT do, dk += dsT q,
    dq += dsT^T k; two kernels, dq's and dk/dv's, would recompute sT and dpT: 7), the
    forward with 2 (s, p v)."""
    assert matmuls_per_block_pair() == {"lctrain_flash_forward": 2,
                                        "lctrain_flash_backward": 5}
