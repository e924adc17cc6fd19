"""Flash attention as Pallas kernels: Mosaic on TPU, interpret mode on CPU.

Same interface and math as `xla.py` (read that first); only the execution differs.

Layout. The kernels work head-major, [b, h, s, d] (kernels/layout.py), so one block is
a [block, d] tile whose last two dims satisfy the TPU tiling rule (block a multiple of
128 or the whole length; d the whole head dim). A call in the model's [b, s, h, d]
swaps axes inside the custom VJP; ring attention calls in head-major and pays no
relayout per step.
Per-token integers and per-row statistics travel as ROWS, [b, 1, s] and [b, h, 1, s]
(reshapes of [b, s] and [b, h, s]): a block is a [1, block] lane vector, so nothing
is padded to 128 lanes in HBM and memory stays linear in s. A kernel that
needs a column ([block, 1], one value per sublane) reshapes the row in VMEM.

Grids (the last axis is the reduction, "arbitrary"):
  forward   (b, hq, q blocks, kv slots), b, hq and q blocks "parallel" (megacore TPUs
            split them across cores): online softmax in VMEM scratch; writes out and
            lse at the last slot.
  backward  (b, hkv, kv blocks, group, q slots), b and hkv "parallel": one kernel
            computes dk, dv and dq from one recomputation of the scores per block pair
            (5 matmuls; separate dq and dk/dv kernels would take 7). dk and dv
            accumulate in VMEM over the g query heads sharing the kv head and over q
            slots, so GQA needs no extra reduction. dq sums over kv blocks, an outer
            axis: it lives in an f32 HBM buffer that each computed step reads and
            writes back by manual DMA (one [block_q, d] f32 block each way, hidden
            under the matmuls; by arithmetic a step stays compute-bound on v5p for
            blocks of 256 and up), so kv blocks stay on one core. Scores are computed transposed ([block_kv, block_q]), so
            lse and delta broadcast as rows.
Query head h reads kv head h // g in the index maps; k and v are never repeated.

Masks come only from positions and segment ids, through per-block bounds in
scalar-prefetch arrays (SMEM): a block pair is skipped, computed without a mask, or
computed with the elementwise mask built from the blocks' [1, block] id rows. A slot
of the reduction axis is mapped (by the index maps and the kernel alike) onto the run
of blocks its row may see, so a skipped pair is not even copied into VMEM
(pallas_schedule.py). No s x s mask exists. Kernel bodies: pallas_kernels.py.

Numerics as in `xla.py` (pallas_kernels.py): rows with no allowed key give out 0,
lse -inf and zero, finite gradients.

Inside shard_map(check_vma=True) the inputs are first cast to vary over the same mesh
axes (so autodiff psums the gradient of a replicated input). Pallas interpret mode
itself fails under check_vma=True (a JAX limitation); Mosaic compiles either way.

GPU: not a Pallas path here (the kernels use TPU-only pieces: scalar prefetch, VMEM
scratch, sequential grid axes carrying accumulators); on GPU `kernels.impl_for_call`
runs `xla.py`'s kernel instead.
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
from .layout import HEADS_MAJOR, TOKENS_MAJOR, relayout, row_dot, seq_len
from .pallas_kernels import N_PREFETCH, backward_kernel, forward_kernel
from .pallas_schedule import KeyMajor, Prefetch, QueryMajor, prefetch_arrays
from .residuals import named_results

_F32 = jnp.float32
_LANES = 128  # TPU vreg lanes: blocks along the sequence are multiples of this
# The forward's and the backward's pallas_call names, which their Mosaic calls carry in
# compiled HLO (parallel/hlo_kernels.py looks for them).
MOSAIC_NAMES = ("lctrain_flash_forward", "lctrain_flash_backward")


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

def _token_rows(x):
    """int [b, s] -> int32 [b, 1, s]: per-token ids as lane rows."""
    return x.astype(jnp.int32)[:, None, :]


def _stat_rows(x):
    """f32 [b, h, s] -> [b, h, 1, s]: per-row statistics as lane rows."""
    return x.astype(_F32)[:, :, None, :]


# ------------------------------------------------------------ pallas_calls ----

class _Specs(NamedTuple):
    """BlockSpecs of one grid, by operand kind."""
    q: pl.BlockSpec         # [b, hq, sq, d] tiles: q, dout, out, dq
    kv: pl.BlockSpec        # [b, hkv, skv, d] tiles: k, v, dk, dv
    q_row: pl.BlockSpec     # [b, 1, sq] int rows: q positions, segment ids
    kv_row: pl.BlockSpec    # [b, 1, skv] int rows
    stat_row: pl.BlockSpec  # [b, hq, 1, sq] f32 rows: lse, delta


def _block_specs(grid, grid_rank, block_q, block_kv, d):
    """Specs whose index maps place every operand by `grid.locate` (pallas_schedule):
    the blocks of the step's (q block, kv block) pair, so a slot outside its row's run
    names the block already in VMEM."""
    def spec(shape, index):
        def index_map(*args):
            step = grid.locate(Prefetch(*args[grid_rank:]), *args[:grid_rank])
            return index(step)
        return pl.BlockSpec(shape, index_map)

    return _Specs(
        q=spec((None, None, block_q, d), lambda s: (s.batch, s.q_head, s.q_block, 0)),
        kv=spec((None, None, block_kv, d), lambda s: (s.batch, s.kv_head, s.kv_block, 0)),
        q_row=spec((None, 1, block_q), lambda s: (s.batch, 0, s.q_block)),
        kv_row=spec((None, 1, block_kv), lambda s: (s.batch, 0, s.kv_block)),
        stat_row=spec((None, None, 1, block_q), lambda s: (s.batch, s.q_head, 0, s.q_block)))


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

    @property
    def scale(self):
        return 1.0 / math.sqrt(self.d)

    def query_major(self):
        """(grid, its locator, its specs): forward and dq."""
        locator = QueryMajor(self.nq, self.nkv, self.g)
        return ((self.b, self.hq, self.nq, self.nkv), locator,
                _block_specs(locator, 4, self.block_q, self.block_kv, self.d))

    def key_major(self):
        """(grid, its locator, its specs): dk and dv."""
        locator = KeyMajor(self.nq, self.nkv, self.g)
        return ((self.b, self.hkv, self.nkv, self.g, self.nq), locator,
                _block_specs(locator, 5, self.block_q, self.block_kv, self.d))


def _problem(q, k, block_q, block_kv):
    """From head-major q and k."""
    b, hq, sq, d = q.shape
    return _Problem(b, hq, k.shape[1], sq, k.shape[2], d, block_q, block_kv)


def _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg, causal, window):
    """The scalar-prefetch arrays and the VMEM id rows (4), in kernel order."""
    return (prefetch_arrays(q_pos, kv_pos, q_seg, kv_seg, pb.block_q, pb.block_kv, causal,
                            window),
            tuple(_token_rows(x) for x in (q_pos, q_seg, kv_pos, kv_seg)))


def _grid_spec(grid, in_specs, out_specs, scratch_shapes):
    return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=N_PREFETCH, grid=grid,
                                        in_specs=in_specs, out_specs=out_specs,
                                        scratch_shapes=scratch_shapes)


def _pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q,
                    block_kv, interpret, layout):
    q, k, v = (relayout(x, layout, HEADS_MAJOR) for x in (q, k, v))
    pb = _problem(q, k, block_q, block_kv)
    grid, locator, specs = pb.query_major()
    prefetch, rows = _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg, causal, window)
    out, lse = pl.pallas_call(
        functools.partial(forward_kernel, grid=locator, causal=causal, window=window,
                          scale=pb.scale),
        grid_spec=_grid_spec(
            grid, [specs.q, specs.kv, specs.kv, specs.q_row, specs.q_row, specs.kv_row,
                   specs.kv_row],
            [specs.q, specs.stat_row],
            [pltpu.VMEM((block_q, pb.d), _F32),   # accumulator
             pltpu.VMEM((block_q, 1), _F32),      # running max
             pltpu.VMEM((block_q, 1), _F32)]),    # running sum
        out_shape=[_result((pb.b, pb.hq, pb.sq, pb.d), q.dtype, q),
                   _result((pb.b, pb.hq, 1, pb.sq), _F32, q)],
        compiler_params=_compiler_params(3, 1),
        interpret=interpret, name=MOSAIC_NAMES[0],
    )(*prefetch, q, k, v, *rows)
    return relayout(out, HEADS_MAJOR, layout), lse[:, :, 0, :]


def _pallas_backward(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal,
                     window, block_q, block_kv, interpret, layout, dq_sum=None, dkv_sum=None):
    """(dq, dk, dv) given delta (layout.row_dot of the rows' out and dout) minus the lse
    cotangent: ds = p * (dp - delta + dlse), one row for both. With `dq_sum` (f32, like
    q) dq is dq_sum plus this call's dq, added in the kernel's own f32 buffer (no second
    q-sized f32 buffer: what ring attention sums over its steps); with `dkv_sum` (a pair
    of f32 arrays like k, aliased to the dk and dv results) likewise dk and dv."""
    q, k, v, dout = (relayout(x, layout, HEADS_MAJOR) for x in (q, k, v, dout))
    pb = _problem(q, k, block_q, block_kv)
    prefetch, rows = _mask_inputs(pb, q_pos, kv_pos, q_seg, kv_seg, causal, window)
    delta = _stat_rows(delta)
    # Empty rows keep lse = -inf: they only occur in masked block pairs, where
    # exp(s - lse) = inf is replaced by 0 before it is used.
    lse = _stat_rows(lse)
    dq_init = (jnp.zeros((pb.b, pb.hq, pb.sq, pb.d), _F32) if dq_sum is None
               else relayout(dq_sum, layout, HEADS_MAJOR))
    kv_sums = () if dkv_sum is None else tuple(relayout(x, layout, HEADS_MAJOR)
                                               for x in dkv_sum)
    sums = _vary_alike(dq_init, *kv_sums, q)[:-1]
    operands = (*prefetch, q, k, v, dout, lse, delta, *rows, *sums)

    grid, locator, specs = pb.key_major()
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_grad_dtype = _F32 if kv_sums else k.dtype
    first_sum = len(operands) - len(sums)
    dq, dk, dv = pl.pallas_call(
        functools.partial(backward_kernel, grid=locator, causal=causal, window=window,
                          scale=pb.scale, block_q=block_q, sums_kv=bool(kv_sums)),
        grid_spec=_grid_spec(
            grid, [specs.q, specs.kv, specs.kv, specs.q, specs.stat_row, specs.stat_row,
                   specs.q_row, specs.q_row, specs.kv_row, specs.kv_row, hbm,
                   *[specs.kv] * len(kv_sums)],
            [hbm, specs.kv, specs.kv],
            [pltpu.VMEM((block_kv, pb.d), _F32),    # dk
             pltpu.VMEM((block_kv, pb.d), _F32),    # dv
             pltpu.VMEM((block_q, pb.d), _F32),     # the dq block being updated
             pltpu.SemaphoreType.DMA((2,)),         # its read, its write
             pltpu.SMEM((1,), jnp.int32)]),         # a write is in flight
        out_shape=[_result(dq_init.shape, _F32, q),
                   _result((pb.b, pb.hkv, pb.skv, pb.d), kv_grad_dtype, q),
                   _result((pb.b, pb.hkv, pb.skv, pb.d), kv_grad_dtype, q)],
        # dq sums over kv blocks: only batch and kv heads may be split across cores.
        compiler_params=_compiler_params(2, 3),
        input_output_aliases={first_sum + i: i for i in range(len(sums))},
        interpret=interpret, name=MOSAIC_NAMES[1],
    )(*operands)
    dq = dq if dq_sum is not None else dq.astype(q.dtype)
    return tuple(relayout(x, HEADS_MAJOR, layout) for x in (dq, dk, dv))


# ------------------------------------------------------------- custom vjp ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv,
           interpret, layout):
    return _pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q,
                           block_kv, interpret, layout)


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv,
               interpret, layout):
    out, lse = named_results(*_pallas_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal,
                                              window, block_q, block_kv, interpret, layout))
    # O(s) residuals only, in the caller's layout (the same buffers as the caller's, not
    # relayouted copies); the backward kernel recomputes scores block by block.
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_bwd(causal, window, block_q, block_kv, interpret, layout, residuals, cotangents):
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    dout, dlse = cotangents
    delta = row_dot(out, dout, layout) - dlse.astype(_F32)
    dq, dk, dv = _pallas_backward(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg,
                                  causal, window, block_q, block_kv, interpret, layout)
    return dq, dk, dv, None, None, None, None  # integer inputs: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------- public api ----

def _blocks(q, k, block_q, block_kv, interpret, layout):
    return (block_size(seq_len(q, layout), block_q, interpret),
            block_size(seq_len(k, layout), block_kv, interpret))


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    *, causal=True, window=None, block_q=512, block_kv=512, platform=None,
                    layout=TOKENS_MAJOR):
    """Pallas flash attention; returns (out in q's layout and dtype, lse [b, hq, sq] f32).

    Differentiable w.r.t. q, k, v, also through lse. `platform` (default: jax's backend)
    picks Mosaic for "tpu", interpret mode for "cpu". `layout`: kernels/layout.py.
    `window` (kernels/masks.py): block pairs wholly outside it are skipped, never copied.
    Shapes are assumed validated by `lctrain.kernels.attention`.
    """
    interpret = (platform or jax.default_backend()) == "cpu"
    operands = _vary_alike(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    return _flash(*operands, bool(causal), window,
                  *_blocks(q, k, block_q, block_kv, interpret, layout), interpret, layout)


def flash_attention_backward(q, k, v, delta, lse, dout, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, *, causal=True, window=None,
                             block_q=512, block_kv=512, platform=None, layout=TOKENS_MAJOR,
                             dq_sum=None, dkv_sum=None):
    """(dq, dk, dv) of attention between q and one kv block, given the rows' FINAL lse
    and delta (layout.row_dot of out and dout; merged over all kv blocks by the caller,
    as ring attention does): then exp(s - lse) is this block's share of the global
    softmax. With `dq_sum` (f32), dq is dq_sum + this block's dq, in f32; with `dkv_sum`
    (f32 pair) dk and dv likewise (the kernel adds into them)."""
    interpret = (platform or jax.default_backend()) == "cpu"
    blocks = _blocks(q, k, block_q, block_kv, interpret, layout)
    q, k, v, delta, lse, dout, *ids = _vary_alike(q, k, v, delta, lse, dout, q_positions,
                                                  kv_positions, q_segment_ids,
                                                  kv_segment_ids)
    return _pallas_backward(q, k, v, delta, lse, dout, *ids, bool(causal), window, *blocks,
                            interpret, layout, dq_sum, dkv_sum)
