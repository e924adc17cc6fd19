"""Flash attention as Pallas kernels: Mosaic on TPU, interpret mode on CPU.

Same interface and math as `xla.py` (read that first); only the execution differs.

Layout. The kernels work head-major: q, k, v, out are transposed (in XLA) to
[b, h, s, d], so one block is a [block, d] tile whose last two dims satisfy the TPU
tiling rule (block a multiple of 128 or the whole length; d the whole head dim).
Per-token integers and per-row statistics travel as ROWS, [b, 1, s] and [b, h, 1, s]
(reshapes of [b, s] and [b, h, s]): a block is a [1, block] lane vector, so nothing
is padded to 128 lanes in HBM and memory stays linear in s. A kernel that
needs a column ([block, 1], one value per sublane) reshapes the row in VMEM.

Grids (the last axis is the reduction, "arbitrary"; the others are "parallel", so
megacore TPUs split them across cores):
  forward  (b, hq, q blocks, kv blocks): online softmax in VMEM scratch; writes out
           and lse at the last kv block.
  dq       (b, hq, q blocks, kv blocks): dq accumulated over kv blocks.
  dk, dv   (b, hkv, kv blocks, group, q blocks): accumulated over the g query heads
           sharing the kv head AND over q blocks, so GQA needs no extra reduction.
           It computes scores transposed ([block_kv, block_q]), so lse and delta
           broadcast as rows and every matmul is a plain A @ B or A @ B^T.
Query head h reads kv head h // g in the index maps; k and v are never repeated.

Masks come only from positions and segment ids. Per block, the wrapper computes
(min, max) of positions and of segment ids and hands them to the kernel as
scalar-prefetch arrays (SMEM). From these bounds each (q block, kv block) pair is
  - skipped (no pair can be allowed: segment ranges disjoint, or causal and the
    latest query precedes the earliest key),
  - computed without a mask (every pair allowed: one common segment and, if causal,
    the earliest query is not before the latest key), or
  - computed with the elementwise mask built from the block's [1, block] rows.
Bounds are conservative (interleaved segments may overlap in range without sharing
an id): a pair is only skipped when it is certainly empty. No s x s mask exists.

Numerics as in `xla.py`: f32 scores, statistics and accumulators; p and ds are cast
to the input dtype for the matmuls (bf16 MXU for bf16 inputs); masked scores get a
large finite value and masked probabilities are zeroed explicitly, so rows with no
allowed key give out 0, lse -inf and zero, finite gradients.

Inside shard_map(check_vma=True) the inputs are first cast to vary over the same mesh
axes (so autodiff psums the gradient of a replicated input). Pallas interpret mode
itself fails under check_vma=True (a JAX limitation); Mosaic compiles either way.

GPU: not a Pallas path here (the kernels use TPU-only pieces: scalar prefetch, VMEM
scratch, sequential grid axes carrying accumulators); on GPU these functions run
`xla.py`'s kernel.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import xla
from .residuals import named_results

_F32 = jnp.float32
_MASK_VALUE = xla._MASK_VALUE  # same finite "minus infinity" as the XLA kernel
_LANES = 128  # TPU vreg lanes: blocks along the sequence are multiples of this


# ----------------------------------------------------------- block sizes ----

def block_size(n: int, cap: int, interpret: bool) -> int:
    """The block actually used along a sequence of length n, given the requested cap.

    Interpret mode has no tiling rule: the largest divisor of n <= cap (as xla.py).
    On TPU a block is a multiple of 128 dividing n (largest <= cap), or all of n.
    """
    if interpret:
        return xla.largest_divisor_at_most(n, cap)
    fits = [m for m in range(_LANES, min(n, max(cap, _LANES)) + 1, _LANES) if n % m == 0]
    if fits:
        return max(fits)
    if n <= max(cap, _LANES):
        return n  # one whole-length block is always a legal tile
    raise ValueError(f"the Pallas TPU kernel needs a sequence length that is a multiple "
                     f"of {_LANES} (or at most the block size {cap}); got {n}")




def _vary_alike(*arrays):
    """Inside shard_map(check_vma=True), cast every array to vary over the union of the
    mesh axes any of them varies over: a pallas_call's outputs carry one such type, and
    the transpose of the cast is the psum that autodiff then inserts for an input that
    did not vary (e.g. replicated k and v). Outside such a shard_map: no-op."""
    axes = frozenset().union(*(_varying_axes(x) for x in arrays))
    return tuple(x if _varying_axes(x) == axes else
                 lax.pcast(x, tuple(sorted(axes - _varying_axes(x))), to="varying")
                 for x in arrays)


def _varying_axes(x):
    return jax.typeof(x).manual_axis_type.varying


def _result(shape, dtype, like):
    """A pallas_call output type that varies over the same mesh axes as `like`."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


# --------------------------------------------------------- layout (XLA) ----

def _heads_major(x):
    """[b, s, h, d] -> [b, h, s, d]: a kernel block is then a [block, d] tile."""
    return jnp.swapaxes(x, 1, 2)


def _token_rows(x):
    """int [b, s] -> int32 [b, 1, s]: per-token ids as lane rows."""
    return x.astype(jnp.int32)[:, None, :]


def _stat_rows(x):
    """f32 [b, h, s] -> [b, h, 1, s]: per-row statistics as lane rows."""
    return x.astype(_F32)[:, :, None, :]


def _block_bounds(positions, segment_ids, block):
    """Flat int32 [b * n * 4]: (pos min, pos max, seg min, seg max) of each block.

    Flat (not [b, n, 4]) because it lives in SMEM, where a 2-D array would be padded.
    """
    b, s = positions.shape
    pos = positions.astype(jnp.int32).reshape(b, s // block, block)
    seg = segment_ids.astype(jnp.int32).reshape(b, s // block, block)
    bounds = jnp.stack([pos.min(-1), pos.max(-1), seg.min(-1), seg.max(-1)], axis=-1)
    return bounds.reshape(-1)


# -------------------------------------------------------- kernel helpers ----

def _read_bounds(bounds_ref, batch, block, n_blocks):
    base = (batch * n_blocks + block) * 4
    return tuple(bounds_ref[base + k] for k in range(4))


def _pair_visibility(q_bounds_ref, kv_bounds_ref, batch, i, j, nq, nkv, causal):
    """(some pair may be allowed, every pair is allowed) for q block i x kv block j."""
    q_lo, q_hi, q_seg_lo, q_seg_hi = _read_bounds(q_bounds_ref, batch, i, nq)
    kv_lo, kv_hi, kv_seg_lo, kv_seg_hi = _read_bounds(kv_bounds_ref, batch, j, nkv)
    some = jnp.logical_and(q_seg_lo <= kv_seg_hi, kv_seg_lo <= q_seg_hi)
    every = jnp.logical_and(jnp.logical_and(q_seg_lo == q_seg_hi, kv_seg_lo == kv_seg_hi),
                            q_seg_lo == kv_seg_lo)
    if causal:
        some = jnp.logical_and(some, q_hi >= kv_lo)
        every = jnp.logical_and(every, q_lo >= kv_hi)
    return some, every


def _run_visible(some, every, compute):
    """compute(masked) on a block pair: unmasked if every pair is allowed, masked if
    only some may be, not at all if none can be."""
    pl.when(every)(lambda: compute(False))
    pl.when(jnp.logical_and(some, jnp.logical_not(every)))(lambda: compute(True))


def _allowed(q_pos, kv_pos, q_seg, kv_seg, causal):
    """Elementwise mask; the orientation ([bq, bk] or [bk, bq]) follows the operands'."""
    allowed = q_seg == kv_seg
    if causal:
        allowed = jnp.logical_and(allowed, q_pos >= kv_pos)
    return allowed


def _column(row_ref):
    """A [1, n] row block -> [n, 1] column (one value per sublane)."""
    return row_ref[...].reshape(-1, 1)


def _dot(a, b):
    """a @ b with f32 accumulation."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_t(a, b):
    """a @ b^T with f32 accumulation (contracts the last dims; no transpose needed)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


# --------------------------------------------------------- forward kernel ----

def _forward_kernel(q_bounds, kv_bounds, q_ref, k_ref, v_ref, q_pos_ref, q_seg_ref,
                    kv_pos_ref, kv_seg_ref, out_ref, lse_ref, acc_ref, max_ref, sum_ref,
                    *, causal, scale, nq, nkv):
    """One (q block, kv block) step of the online softmax for one query head."""
    batch, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _start_row_block():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        max_ref[...] = jnp.full_like(max_ref, _MASK_VALUE)
        sum_ref[...] = jnp.zeros_like(sum_ref)

    def fold_kv_block(masked):
        v = v_ref[...]
        s = _dot_t(q_ref[...], k_ref[...]) * scale  # [bq, bk]
        if masked:
            mask = _allowed(_column(q_pos_ref), kv_pos_ref[...], _column(q_seg_ref),
                            kv_seg_ref[...], causal)
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

    some, every = _pair_visibility(q_bounds, kv_bounds, batch, i, j, nq, nkv, causal)
    _run_visible(some, every, fold_kv_block)

    @pl.when(j == nkv - 1)
    def _normalize():
        # A row with an allowed key has sum >= 1 (its max contributes exp(0)).
        row_sum = sum_ref[...]
        has_keys = row_sum > 0
        safe_sum = jnp.where(has_keys, row_sum, 1.0)
        out_ref[...] = (acc_ref[...] / safe_sum).astype(out_ref.dtype)
        lse = jnp.where(has_keys, max_ref[...] + jnp.log(safe_sum), -jnp.inf)
        lse_ref[...] = lse.reshape(1, -1)  # column -> the row layout of lse


# -------------------------------------------------------- backward kernels ----

def _dq_kernel(q_bounds, kv_bounds, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref,
               q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, dq_ref, dq_acc_ref,
               *, causal, scale, nq, nkv):
    """dq += scale * ds k over kv blocks, ds = p * (dp - delta), p = exp(s - lse)."""
    batch, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        dq_acc_ref[...] = jnp.zeros_like(dq_acc_ref)

    def accumulate(masked):
        k = k_ref[...]
        s = _dot_t(q_ref[...], k) * scale  # [bq, bk]
        p = jnp.exp(s - _column(lse_ref))  # exact softmax probs from the final lse
        if masked:
            p = jnp.where(_allowed(_column(q_pos_ref), kv_pos_ref[...], _column(q_seg_ref),
                                   kv_seg_ref[...], causal), p, 0.0)
        dp = _dot_t(dout_ref[...], v_ref[...])
        ds = p * (dp - _column(delta_ref))
        dq_acc_ref[...] += _dot(ds.astype(k.dtype), k)

    some, every = _pair_visibility(q_bounds, kv_bounds, batch, i, j, nq, nkv, causal)
    _run_visible(some, every, accumulate)

    @pl.when(j == nkv - 1)
    def _finish():
        dq_ref[...] = (scale * dq_acc_ref[...]).astype(dq_ref.dtype)


def _dkv_kernel(q_bounds, kv_bounds, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref,
                q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, dk_ref, dv_ref,
                dk_acc_ref, dv_acc_ref, *, causal, scale, nq, nkv):
    """dv += p^T do and dk += scale * ds^T q over (group member, q block), in the
    transposed orientation: pT = exp(k q^T * scale - lse_row), [bk, bq]."""
    batch, j = pl.program_id(0), pl.program_id(2)
    member, i = pl.program_id(3), pl.program_id(4)
    last_member, last_i = pl.num_programs(3) - 1, pl.num_programs(4) - 1

    @pl.when(jnp.logical_and(member == 0, i == 0))
    def _start():
        dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
        dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

    def accumulate(masked):
        q, dout = q_ref[...], dout_ref[...]
        s_t = _dot_t(k_ref[...], q) * scale  # [bk, bq]
        p_t = jnp.exp(s_t - lse_ref[...])
        if masked:
            p_t = jnp.where(_allowed(q_pos_ref[...], _column(kv_pos_ref), q_seg_ref[...],
                                     _column(kv_seg_ref), causal), p_t, 0.0)
        dv_acc_ref[...] += _dot(p_t.astype(dout.dtype), dout)
        dp_t = _dot_t(v_ref[...], dout)
        ds_t = p_t * (dp_t - delta_ref[...])
        dk_acc_ref[...] += _dot(ds_t.astype(q.dtype), q)

    some, every = _pair_visibility(q_bounds, kv_bounds, batch, i, j, nq, nkv, causal)
    _run_visible(some, every, accumulate)

    @pl.when(jnp.logical_and(member == last_member, i == last_i))
    def _finish():
        dk_ref[...] = (scale * dk_acc_ref[...]).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


# ------------------------------------------------------------ pallas_calls ----

class _Specs(NamedTuple):
    """BlockSpecs of one grid, by operand kind."""
    q: pl.BlockSpec         # [b, hq, sq, d] tiles: q, dout, out, dq
    kv: pl.BlockSpec        # [b, hkv, skv, d] tiles: k, v, dk, dv
    q_row: pl.BlockSpec     # [b, 1, sq] int rows: q positions, segment ids
    kv_row: pl.BlockSpec    # [b, 1, skv] int rows
    stat_row: pl.BlockSpec  # [b, hq, 1, sq] f32 rows: lse, delta


def _block_specs(locate, grid_rank, block_q, block_kv, d):
    """Specs for a grid whose index tuple `locate` maps to (batch, q head, kv head,
    q block, kv block). Index maps also receive the scalar-prefetch refs: dropped."""
    def spec(shape, index):
        return pl.BlockSpec(shape, lambda *args: index(*locate(*args[:grid_rank])))

    return _Specs(
        q=spec((None, None, block_q, d), lambda b, h, hk, i, j: (b, h, i, 0)),
        kv=spec((None, None, block_kv, d), lambda b, h, hk, i, j: (b, hk, j, 0)),
        q_row=spec((None, 1, block_q), lambda b, h, hk, i, j: (b, 0, i)),
        kv_row=spec((None, 1, block_kv), lambda b, h, hk, i, j: (b, 0, j)),
        stat_row=spec((None, None, 1, block_q), lambda b, h, hk, i, j: (b, h, 0, i)))


def _compiler_params(n_parallel, n_arbitrary):
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) * n_parallel + ("arbitrary",) * n_arbitrary)


class _Problem(NamedTuple):
    """Static sizes shared by the three pallas_calls."""
    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    block_q: int
    block_kv: int

    @property
    def g(self):
        return self.hq // self.hkv

    @property
    def nq(self):
        return self.sq // self.block_q

    @property
    def nkv(self):
        return self.skv // self.block_kv

    def kernel_params(self, causal):
        return dict(causal=causal, scale=1.0 / math.sqrt(self.d), nq=self.nq, nkv=self.nkv)

    def query_major_specs(self):
        """Grid (b, hq, q block, kv block): forward and dq."""
        g = self.g
        return _block_specs(lambda b, h, i, j: (b, h, h // g, i, j), 4,
                            self.block_q, self.block_kv, self.d)

    def key_major_specs(self):
        """Grid (b, hkv, kv block, group member, q block): dk and dv."""
        g = self.g
        return _block_specs(lambda b, hk, j, m, i: (b, hk * g + m, hk, i, j), 5,
                            self.block_q, self.block_kv, self.d)


def _problem(q, k, block_q, block_kv):
    b, sq, hq, d = q.shape
    return _Problem(b, hq, k.shape[2], sq, k.shape[1], d, block_q, block_kv)


def _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg):
    """Scalar-prefetch block bounds (2) and the VMEM id rows (4), in kernel order."""
    return ((_block_bounds(q_pos, q_seg, pb.block_q), _block_bounds(kv_pos, kv_seg, pb.block_kv)),
            tuple(_token_rows(x) for x in (q_pos, q_seg, kv_pos, kv_seg)))


def _pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, block_q, block_kv,
                    interpret):
    pb = _problem(q, k, block_q, block_kv)
    specs = pb.query_major_specs()
    bounds, rows = _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg)
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, **pb.kernel_params(causal)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(pb.b, pb.hq, pb.nq, pb.nkv),
            in_specs=[specs.q, specs.kv, specs.kv,
                      specs.q_row, specs.q_row, specs.kv_row, specs.kv_row],
            out_specs=[specs.q, specs.stat_row],
            scratch_shapes=[pltpu.VMEM((block_q, pb.d), _F32),   # accumulator
                            pltpu.VMEM((block_q, 1), _F32),      # running max
                            pltpu.VMEM((block_q, 1), _F32)]),    # running sum
        out_shape=[_result((pb.b, pb.hq, pb.sq, pb.d), q.dtype, q),
                   _result((pb.b, pb.hq, 1, pb.sq), _F32, q)],
        compiler_params=_compiler_params(3, 1),
        interpret=interpret, name="lctrain_flash_forward",
    )(*bounds, _heads_major(q), _heads_major(k), _heads_major(v), *rows)
    return _heads_major(out), lse[:, :, 0, :]


def _pallas_backward(q, k, v, out, lse, dout, dlse, q_pos, kv_pos, q_seg, kv_seg, causal,
                     block_q, block_kv, interpret):
    pb = _problem(q, k, block_q, block_kv)
    bounds, rows = _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg)
    # delta_i = sum_d do_i o_i (the softmax-Jacobian term) minus the lse cotangent:
    # ds = p * (dp - delta + dlse) = p * (dp - (delta - dlse)), one row for both.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(_F32), out.astype(_F32))
    delta = _stat_rows(delta - dlse.astype(_F32))
    # Empty rows keep lse = -inf: they only occur in masked block pairs, where
    # exp(s - lse) = inf is replaced by 0 before it is used.
    lse = _stat_rows(lse)
    operands = (*bounds, *(_heads_major(x) for x in (q, k, v, dout)), lse, delta, *rows)
    params = pb.kernel_params(causal)

    specs = pb.query_major_specs()
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(pb.b, pb.hq, pb.nq, pb.nkv),
            in_specs=[specs.q, specs.kv, specs.kv, specs.q, specs.stat_row, specs.stat_row,
                      specs.q_row, specs.q_row, specs.kv_row, specs.kv_row],
            out_specs=specs.q,
            scratch_shapes=[pltpu.VMEM((block_q, pb.d), _F32)]),
        out_shape=_result((pb.b, pb.hq, pb.sq, pb.d), q.dtype, q),
        compiler_params=_compiler_params(3, 1),
        interpret=interpret, name="lctrain_flash_dq",
    )(*operands)

    specs = pb.key_major_specs()
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **params),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(pb.b, pb.hkv, pb.nkv, pb.g, pb.nq),
            in_specs=[specs.q, specs.kv, specs.kv, specs.q, specs.stat_row, specs.stat_row,
                      specs.q_row, specs.q_row, specs.kv_row, specs.kv_row],
            out_specs=[specs.kv, specs.kv],
            scratch_shapes=[pltpu.VMEM((block_kv, pb.d), _F32),    # dk
                            pltpu.VMEM((block_kv, pb.d), _F32)]),  # dv
        out_shape=[_result((pb.b, pb.hkv, pb.skv, pb.d), k.dtype, q),
                   _result((pb.b, pb.hkv, pb.skv, pb.d), v.dtype, q)],
        compiler_params=_compiler_params(3, 2),
        interpret=interpret, name="lctrain_flash_dkv",
    )(*operands)
    return _heads_major(dq), _heads_major(dk), _heads_major(dv)


# ------------------------------------------------------------- custom vjp ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, block_q, block_kv, interpret):
    return _pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, block_q,
                           block_kv, interpret)


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, block_q, block_kv, interpret):
    out, lse = named_results(*_pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal,
                                              block_q, block_kv, interpret))
    # O(s) residuals only; the backward kernels recompute scores block by block.
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_bwd(causal, block_q, block_kv, interpret, residuals, cotangents):
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    dout, dlse = cotangents
    dq, dk, dv = _pallas_backward(q, k, v, out, lse, dout, dlse, q_pos, kv_pos, q_seg,
                                  kv_seg, causal, block_q, block_kv, interpret)
    return dq, dk, dv, None, None, None, None  # integer inputs: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------- public api ----

def _target(platform):
    """The platform the program is compiled for; the default backend unless told (an
    ahead-of-time compile for a TPU topology runs on a CPU host)."""
    return platform or jax.default_backend()


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    *, causal=True, block_q=512, block_kv=512, platform=None):
    """Pallas flash attention; returns (out [b, sq, hq, d] in q.dtype, lse [b, hq, sq] f32).

    Differentiable w.r.t. q, k, v, also through lse. `platform` (default: jax's backend)
    picks Mosaic for "tpu", interpret mode for "cpu", and xla.py's kernel for "gpu".
    Shapes are assumed validated by `lctrain.kernels.attention`.
    """
    if _target(platform) == "gpu":
        return xla.flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids,
                                   kv_segment_ids, causal=causal, block_q=block_q,
                                   block_kv=block_kv)
    interpret = _target(platform) == "cpu"
    block_q = block_size(q.shape[1], block_q, interpret)
    block_kv = block_size(k.shape[1], block_kv, interpret)
    operands = _vary_alike(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    return _flash(*operands, bool(causal), block_q, block_kv, interpret)


def flash_attention_backward(q, k, v, out, lse, dout, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, *, causal=True, block_q=512,
                             block_kv=512, platform=None):
    """(dq, dk, dv) of attention between q and one kv block, given the rows' FINAL out
    and lse (merged over all kv blocks by the caller, as ring attention does): then
    exp(s - lse) is this block's share of the global softmax."""
    if _target(platform) == "gpu":
        return xla.flash_attention_backward(
            q, k, v, out, lse, dout, q_positions, kv_positions, q_segment_ids,
            kv_segment_ids, causal=causal, block_q=block_q, block_kv=block_kv)
    interpret = _target(platform) == "cpu"
    block_q = block_size(q.shape[1], block_q, interpret)
    block_kv = block_size(k.shape[1], block_kv, interpret)
    q, k, v, out, lse, dout, *ids = _vary_alike(q, k, v, out, lse, dout, q_positions,
                                                kv_positions, q_segment_ids, kv_segment_ids)
    return _pallas_backward(q, k, v, out, lse, dout, jnp.zeros_like(lse), *ids,
                            bool(causal), block_q, block_kv, interpret)
