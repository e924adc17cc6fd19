"""The Pallas kernel bodies of kernels/pallas.py: one grid step each.

Every kernel receives the scalar-prefetch arrays first (pallas_schedule.Prefetch), then
its blocks. A step finds its blocks and whether to compute through the grid's `locate`
(pallas_schedule), the same function its index maps use, so a kernel computes exactly
the pair whose blocks the pipeline brought into VMEM.

Numerics as in `xla.py`: f32 scores, statistics and accumulators; p and ds are cast to
the input dtype for the matmuls (bf16 MXU for bf16 inputs); masked scores get a large
finite value and masked probabilities are zeroed explicitly, so rows with no allowed key
give out 0, lse -inf and zero, finite gradients.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import xla
from .masks import pair_allowed
from .pallas_schedule import Prefetch, step_visibility

_F32 = jnp.float32
_MASK_VALUE = xla._MASK_VALUE  # same finite "minus infinity" as the XLA kernel
N_PREFETCH = len(Prefetch._fields)


def _program_ids(rank):
    return tuple(pl.program_id(axis) for axis in range(rank))


def _run_visible(some, every, compute):
    """compute(masked) on a block pair: unmasked if every pair is allowed, masked if
    only some may be, not at all if none can be."""
    pl.when(every)(lambda: compute(False))
    pl.when(jnp.logical_and(some, jnp.logical_not(every)))(lambda: compute(True))


def _column(row_ref):
    """A [1, n] row block -> [n, 1] column (one value per sublane)."""
    return row_ref[...].reshape(-1, 1)


def _dot(a, b):
    """a @ b with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_tn(a, b):
    """a^T @ b with f32 accumulation (contracts the first dims)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_t(a, b):
    """a @ b^T with f32 accumulation (contracts the last dims; no transpose needed)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


# --------------------------------------------------------- forward kernel ----

def forward_kernel(*refs, grid, causal, window, scale):
    """One (q block, kv slot) step of the online softmax for one query head."""
    pf = Prefetch(*refs[:N_PREFETCH])
    (q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, out_ref, lse_ref,
     acc_ref, max_ref, sum_ref) = refs[N_PREFETCH:]
    ids = _program_ids(4)
    slot = ids[3]

    @pl.when(slot == 0)
    def _start_row_block():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        max_ref[...] = jnp.full_like(max_ref, _MASK_VALUE)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    def fold_kv_block(masked):
        v = v_ref[...]
        s = _dot_t(q_ref[...], k_ref[...]) * scale  # [bq, bk]
        if masked:
            mask = pair_allowed(_column(q_pos_ref), kv_pos_ref[...], _column(q_seg_ref),
                                kv_seg_ref[...], causal, window)
            s = jnp.where(mask, s, _MASK_VALUE)
        row_max = max_ref[...]
        new_max = jnp.maximum(row_max, s.max(axis=1, keepdims=True))
        p = jnp.exp(s - new_max)
        if masked:  # a row with nothing allowed yet has s == new_max: exp(0) must not count
            p = jnp.where(mask, p, 0.0)
        # Rescale what was accumulated under the old max (both finite, factor <= 1).
        correction = jnp.exp(row_max - new_max)
        sum_ref[...] = correction * sum_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = correction * acc_ref[...] + _dot(p.astype(v.dtype), v)
        max_ref[...] = new_max

    _, some, every = step_visibility(pf, grid, causal, window, *ids)
    _run_visible(some, every, fold_kv_block)

    @pl.when(slot == grid.nkv - 1)
    def _normalize():
        # A row with an allowed key has sum >= 1 (its max contributes exp(0)).
        row_sum = sum_ref[...]
        has_keys = row_sum > 0
        safe_sum = jnp.where(has_keys, row_sum, 1.0)
        out_ref[...] = (acc_ref[...] / safe_sum).astype(out_ref.dtype)
        lse = jnp.where(has_keys, max_ref[...] + jnp.log(safe_sum), -jnp.inf)
        lse_ref[...] = lse.reshape(1, -1)  # column -> the row layout of lse


# --------------------------------------------------------- backward kernel ----

def backward_kernel(*refs, grid, causal, window, scale, block_q, sums_kv):
    """dk, dv and dq of one (kv block, group member, q slot) step from one recomputation
    of the scores, in the transposed orientation pT = exp(k q^T * scale - lse_row)
    ([bk, bq]): dv += pT do, dk += dsT q, dq[q block] += scale * dsT^T k (into whatever
    the dq buffer held: zeros, or a caller's running sum). dq sums over the kv blocks of
    an outer grid axis, so it cannot stay in VMEM: it is read from and written back to an
    f32 HBM buffer by manual DMA, and a step waits for the previous write before it reads
    (a block may recur at once). With `sums_kv`, two more inputs (a caller's running
    dk and dv sums, f32, aliased to the dk and dv outputs) are added to the block's dk
    and dv as they are written."""
    pf = Prefetch(*refs[:N_PREFETCH])
    inputs = 13 if sums_kv else 11
    (q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, q_pos_ref, q_seg_ref, kv_pos_ref,
     kv_seg_ref, _, *kv_sums) = refs[N_PREFETCH:N_PREFETCH + inputs]
    (dq_hbm, dk_ref, dv_ref, dk_acc_ref, dv_acc_ref, dq_buf, sems,
     writing) = refs[N_PREFETCH + inputs:]
    ids = _program_ids(5)
    j, member, slot = ids[2:]
    last_member, last_slot = pl.num_programs(3) - 1, pl.num_programs(4) - 1
    step, some, every = step_visibility(pf, grid, causal, window, *ids)
    dq_block = dq_hbm.at[step.batch, step.q_head, pl.ds(step.q_block * block_q, block_q)]
    dq_read = pltpu.make_async_copy(dq_block, dq_buf, sems.at[0])
    dq_write = pltpu.make_async_copy(dq_buf, dq_block, sems.at[1])

    def finish_write():
        pl.when(writing[0] == 1)(dq_write.wait)
        writing[0] = 0

    @pl.when(jnp.logical_and(member == 0, slot == 0))
    def _start():
        dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
        dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

        @pl.when(j == 0)
        def _no_write_yet():
            writing[0] = 0

    def accumulate(masked):
        finish_write()
        dq_read.start()
        q, k, dout = q_ref[...], k_ref[...], dout_ref[...]
        s_t = _dot_t(k, q) * scale  # [bk, bq]
        p_t = jnp.exp(s_t - lse_ref[...])
        if masked:
            p_t = jnp.where(pair_allowed(q_pos_ref[...], _column(kv_pos_ref), q_seg_ref[...],
                                         _column(kv_seg_ref), causal, window), p_t, 0.0)
        dv_acc_ref[...] += _dot(p_t.astype(dout.dtype), dout)
        ds_t = (p_t * (_dot_t(v_ref[...], dout) - delta_ref[...])).astype(q.dtype)
        dk_acc_ref[...] += _dot(ds_t, q)
        dq_read.wait()
        dq_buf[...] += scale * _dot_tn(ds_t, k)
        dq_write.start()
        writing[0] = 1

    _run_visible(some, every, accumulate)

    @pl.when(jnp.logical_and(member == last_member, slot == last_slot))
    def _finish():
        dk, dv = scale * dk_acc_ref[...], dv_acc_ref[...]
        if kv_sums:
            dk, dv = dk + kv_sums[0][...], dv + kv_sums[1][...]
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv.astype(dv_ref.dtype)
        pl.when(j == pl.num_programs(2) - 1)(finish_write)
