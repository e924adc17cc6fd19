"""Which block pairs the Pallas kernels visit, and in which order (kernels/pallas.py).

Block bounds. Per block the wrapper computes, in XLA, six int32 bounds of its tokens:
positions (min, max), segment ids (min, max), the latest position among the tokens of
its LAST segment and the earliest among those of its FIRST segment. From these a
(q block, kv block) pair is skipped when no pair can be allowed, computed without a
mask when every pair is, and masked otherwise (`pair_visibility`). The last two bounds
matter for packed documents whose positions restart: a q block and a later kv block
sharing only one document (q's last, kv's first) are empty when that document's keys
come after its queries, although kv's next document starts at position 0.
A sliding window (kernels/masks.py) skips a pair whose nearest tokens are already
`window` apart (q's earliest position minus kv's latest), and leaves it unmasked only
if its farthest ones are not (q's latest minus kv's earliest): so a q block computes
about window / block_kv + 1 kv blocks, the band along the diagonal.

Visit order. The Pallas TPU pipeline copies an operand's block from HBM only when its
block index differs from the previous grid step's. So the grid's reduction axis does
not name a block directly but a SLOT: per grid row (a q block in the query-major grids,
a kv block in the key-major one) the blocks of the other side are sorted by
(segment min, segment max, position min), which for documents stored in sequence order
(or chunks of one sequence, however permuted, with positions being sequence indices)
restores the sequence order, so the blocks a row may see form one run of ranks (the
window cuts the run's far end, keeping it one run). A row
stores (first rank, count): slot t visits rank clamp(t, first, first + count - 1), so
the slots before and after the run repeat a block already in VMEM (no copy, no
compute). A row with nothing to see repeats the block its neighbour in grid order
holds: the next row's first if there is one, else the previous row's last.

Scalar memory: a few int32 per block (O(blocks), never per block pair), flat 1-D
arrays because SMEM pads 2-D arrays. XLA builds the [b, nq, nkv] visibility once per
call to derive the runs; that is per block pair, but in HBM and tiny next to q.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from .masks import every_key_visible, some_keys_visible, some_segments_shared

_N_BOUNDS = 6  # pos min, pos max, seg min, seg max, pos max in seg max, pos min in seg min
_ROW_FIELDS = 3  # first rank, count, "an empty row repeats the previous row's block"
_INT32 = jnp.int32


class Prefetch(NamedTuple):
    """The scalar-prefetch (SMEM) arrays of every kernel, all flat int32."""
    q_bounds: object   # [b * nq * 6]
    kv_bounds: object  # [b * nkv * 6]
    kv_order: object   # [b * nkv]: kv block at each rank, for the query-major grids
    kv_rows: object    # [b * nq * 3]: the run of kv ranks of each q block
    q_order: object    # [b * nq]: q block at each rank, for the key-major grid
    q_rows: object     # [b * nkv * 3]: the run of q ranks of each kv block


class Step(NamedTuple):
    """What one grid step works on; `active`: the step is inside its row's run."""
    batch: object
    q_head: object
    kv_head: object
    q_block: object
    kv_block: object
    active: object


# ------------------------------------------------------------- bounds (XLA) ----

def block_bounds(positions, segment_ids, block):
    """Flat int32 [b * n * 6]: the bounds of each block (module docstring)."""
    b, s = positions.shape
    pos = positions.astype(_INT32).reshape(b, s // block, block)
    seg = segment_ids.astype(_INT32).reshape(b, s // block, block)
    seg_lo, seg_hi = seg.min(-1), seg.max(-1)
    big = jnp.iinfo(_INT32).max
    pos_hi_in_last = jnp.where(seg == seg_hi[..., None], pos, -big).max(-1)
    pos_lo_in_first = jnp.where(seg == seg_lo[..., None], pos, big).min(-1)
    bounds = jnp.stack([pos.min(-1), pos.max(-1), seg_lo, seg_hi, pos_hi_in_last,
                        pos_lo_in_first], axis=-1)
    return bounds.reshape(-1)


def _read_bounds(bounds, batch, block, n_blocks):
    base = (batch * n_blocks + block) * _N_BOUNDS
    return tuple(bounds[base + k] for k in range(_N_BOUNDS))


def pair_visibility(q_bounds, kv_bounds, batch, i, j, nq, nkv, causal, window=None):
    """(some pair may be allowed, every pair is allowed) for q block i x kv block j.

    Works on SMEM refs inside a kernel and, broadcasting, on arrays in XLA: the runs are
    derived from the very test the kernels apply."""
    q_lo, q_hi, q_seg_lo, q_seg_hi, q_hi_in_last, _ = _read_bounds(q_bounds, batch, i, nq)
    kv_lo, kv_hi, kv_seg_lo, kv_seg_hi, _, kv_lo_in_first = _read_bounds(
        kv_bounds, batch, j, nkv)
    some = some_segments_shared(q_seg_lo, q_seg_hi, kv_seg_lo, kv_seg_hi)
    some = jnp.logical_and(some, some_keys_visible(q_lo, q_hi, kv_lo, kv_hi, causal, window))
    if causal:
        # Sharing only q's last segment (= kv's first), compare within that segment.
        only_shared = q_seg_hi == kv_seg_lo
        some = jnp.logical_and(some, jnp.logical_or(jnp.logical_not(only_shared),
                                                    q_hi_in_last >= kv_lo_in_first))
    one_segment = jnp.logical_and(jnp.logical_and(q_seg_lo == q_seg_hi, kv_seg_lo == kv_seg_hi),
                                  q_seg_lo == kv_seg_lo)
    every = jnp.logical_and(one_segment,
                            every_key_visible(q_lo, q_hi, kv_lo, kv_hi, causal, window))
    return some, every


# --------------------------------------------------------------- runs (XLA) ----

def _block_order(bounds, b, n):
    """int32 [b, n]: blocks sorted by (segment min, segment max, position min)."""
    per_block = bounds.reshape(b, n, _N_BOUNDS)
    keys = (per_block[..., 0], per_block[..., 3], per_block[..., 2])  # last key first
    return jnp.lexsort(keys, axis=-1).astype(_INT32)


def _row_runs(visible):
    """bool [b, rows, n] (n in rank order) -> int32 [b, rows, 3]: each row's run of
    ranks (first, count) and, for an empty row, whether it repeats the previous row's
    last rank (1) or the next row's first (0)."""
    rows, n = visible.shape[1:]
    nonempty = visible.any(-1)
    first = jnp.argmax(visible, -1)
    last = n - 1 - jnp.argmax(visible[..., ::-1], -1)
    row = jnp.arange(rows)
    next_row = lax.cummin(jnp.where(nonempty, row, rows), axis=1, reverse=True)
    prev_row = lax.cummax(jnp.where(nonempty, row, -1), axis=1)
    has_next, has_prev = next_row < rows, prev_row >= 0
    next_first = jnp.take_along_axis(first, jnp.minimum(next_row, rows - 1), axis=1)
    prev_last = jnp.take_along_axis(last, jnp.maximum(prev_row, 0), axis=1)
    fill = jnp.where(has_next, next_first, jnp.where(has_prev, prev_last, 0))
    from_prev = jnp.logical_and(jnp.logical_not(has_next), has_prev)
    return jnp.stack([jnp.where(nonempty, first, fill),
                      jnp.where(nonempty, last - first + 1, 0),
                      jnp.logical_and(jnp.logical_not(nonempty), from_prev)],
                     axis=-1).astype(_INT32)


def prefetch_arrays(q_pos, kv_pos, q_seg, kv_seg, block_q, block_kv, causal, window=None):
    """The Prefetch of one attention call."""
    q_bounds = block_bounds(q_pos, q_seg, block_q)
    kv_bounds = block_bounds(kv_pos, kv_seg, block_kv)
    b, nq, nkv = q_pos.shape[0], q_pos.shape[1] // block_q, kv_pos.shape[1] // block_kv
    some, _ = pair_visibility(q_bounds, kv_bounds, jnp.arange(b)[:, None, None],
                              jnp.arange(nq)[None, :, None], jnp.arange(nkv)[None, None, :],
                              nq, nkv, causal, window)
    kv_order, q_order = _block_order(kv_bounds, b, nkv), _block_order(q_bounds, b, nq)
    kv_rows = _row_runs(jnp.take_along_axis(some, kv_order[:, None, :], axis=2))
    q_rows = _row_runs(jnp.take_along_axis(jnp.swapaxes(some, 1, 2), q_order[:, None, :],
                                           axis=2))
    return Prefetch(q_bounds, kv_bounds, kv_order.reshape(-1), kv_rows.reshape(-1),
                    q_order.reshape(-1), q_rows.reshape(-1))


# ------------------------------------------------- grids (index maps, kernels) ----

def _slot(rows, row, slot):
    """(rank visited at `slot` of `row`, whether the slot is inside the row's run)."""
    first, count = rows[row * _ROW_FIELDS], rows[row * _ROW_FIELDS + 1]
    rank = jnp.minimum(jnp.maximum(slot, first), first + jnp.maximum(count, 1) - 1)
    return rank, jnp.logical_and(slot >= first, slot < first + count)


class QueryMajor(NamedTuple):
    """Grid (batch, q head, q block, kv slot): forward and dq."""
    nq: int
    nkv: int
    g: int

    def locate(self, pf: Prefetch, b, h, i, t) -> Step:
        rank, active = _slot(pf.kv_rows, b * self.nq + i, t)
        return Step(b, h, h // self.g, i, pf.kv_order[b * self.nkv + rank], active)


class KeyMajor(NamedTuple):
    """Grid (batch, kv head, kv block, group member, q slot): dk and dv. An empty kv
    row keeps one q head too (member 0 or g - 1, whichever its neighbour ends on)."""
    nq: int
    nkv: int
    g: int

    def locate(self, pf: Prefetch, b, hk, j, m, t) -> Step:
        row = b * self.nkv + j
        rank, active = _slot(pf.q_rows, row, t)
        empty = pf.q_rows[row * _ROW_FIELDS + 1] == 0
        member = jnp.where(empty, pf.q_rows[row * _ROW_FIELDS + 2] * (self.g - 1), m)
        return Step(b, hk * self.g + member, hk, pf.q_order[b * self.nq + rank], j, active)


def step_visibility(pf: Prefetch, grid, causal, window, *grid_indices):
    """(Step, computed at all, computed without a mask) of one grid step."""
    step = grid.locate(pf, *grid_indices)
    some, every = pair_visibility(pf.q_bounds, pf.kv_bounds, step.batch, step.q_block,
                                  step.kv_block, grid.nq, grid.nkv, causal, window)
    return step, jnp.logical_and(step.active, some), jnp.logical_and(step.active, every)
