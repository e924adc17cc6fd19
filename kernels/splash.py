"""Splash attention: jax's block-sparse flash kernel for TPU, behind our kernel interface.

Splash (jax.experimental.pallas.ops.tpu.splash_attention; tokamax vendors the same
kernels) skips work by a block map, its `MaskInfo`: for every (q block, kv block) pair,
0 = nothing allowed (never computed, never fetched), 2 = everything allowed (no mask), 1 =
partially allowed (an elementwise pattern from `partial_mask_blocks`). Splash's own
constructors build that map in NumPy from a static mask, block by block: measured 80 s at
128K tokens and about 85 minutes at 1M, per mask, before anything compiles. And a static
mask cannot follow our layouts, where every device (and every ring step) sees different
positions. So this module builds the map in jnp from the positions, at run time, in
O(blocks^2) integer work, and calls splash's forward, dq and dk/dv kernels directly.

The layout it needs. Positions must be the tokens' indices in the sequence, running
contiguously through every q block (kv block), each starting at a multiple of its size.
Then a pair of blocks is entirely in the past (full), entirely in the future (empty), or
overlapping by a whole number of the smaller block, where the allowed keys form one of a
few fixed "diagonal" patterns (`_patterns`; one when q and kv blocks are equal). Every
context-parallel strategy hands the kernel such positions (`ContextStrategy.attend`
passes sequence indices, not the per-document RoPE positions; documents are kept apart
by segment ids, which splash applies to every computed block), as long as each chunk of
the stored sequence is a multiple of the blocks (128 tokens at least, checked when the
recipe loads). A layout that breaks the rule makes the output NaN, not silently wrong;
on a chip it can halt the TPU instead (a v5e did, in the dk/dv kernel, given positions
that restart in every packed document), which is why only sequence indices reach it.

The map lives in the kernel's scalar memory (1 MiB SMEM on v5p), so it is kept to
`_MAP_ENTRIES` pairs by fetching longer kv blocks at long context (up to `_MAX_KV_BLOCK`,
computed in slices of the requested size): at 1M tokens on 4 chips a ring step (256K x
256K) takes 1024-token kv blocks; all_gather's 256K queries x 1M keys do not fit.

No sliding window: splash's LocalMask is a static NumPy mask, which cannot follow our
run-time block maps, so `kernels.impl_for_call` runs windowed calls of impl=auto on
the Pallas kernel (which skips blocks outside the window) and refuses impl=splash.

Rows with no allowed key get out 0 and lse -inf like the other kernels (splash itself
would divide by zero). The backward folds the lse cotangent into splash's per-row
`delta`, so the result is differentiable through lse as well; ring attention instead
calls `flash_attention_backward` with the merged out/lse of all its steps.

Pinned to splash's private functions (`_splash_attention_forward`, `..._bwd_dq`,
`..._bwd_dkv`, `MaskInfo`): tests/test_splash.py checks them against the dense reference
on every jax we support. TPU only: on CPU the kernels run in Pallas interpret mode (tests);
on GPU `kernels.impl_for_call` runs xla.py instead. Splash works head-major
([b, h, s, d], kernels/layout.py); a call in [b, s, h, d] swaps axes inside the custom VJP.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

from .layout import HEADS_MAJOR, TOKENS_MAJOR, relayout, row_dot, seq_len
from .masks import every_key_visible, some_keys_visible, some_segments_shared
from .residuals import named_results

_LANES = splash.NUM_LANES  # splash tiles the sequence in multiples of 128, even interpreted
_MASK_VALUE = splash.DEFAULT_MASK_VALUE
_EMPTY, _PARTIAL, _FULL = 0, 1, 2
# How splash's forward, dq and dk/dv Mosaic calls are named in compiled HLO (prefixes).
MOSAIC_NAMES = ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")
# The block map lives in scalar memory (SMEM, 1 MiB on v5p) next to the kernel's own
# scalars: at most this many (q block, kv block) entries, 4 bytes each (int16 fetch
# order, int8 kind, int8 pattern); 2**18 overflowed a v5p compile. Longer kv sequences get
# longer kv blocks, up to _MAX_KV_BLOCK: the pattern block ([block_q, block_kv], int32 in
# VMEM, double-buffered) of 512 x 4096 overflowed the 16 MiB scoped VMEM; 1024 compiles.
_MAP_ENTRIES = 2**17
_MAX_KV_BLOCK = 1024


class Blocks(NamedTuple):
    """Tile sizes: q blocks of `q` tokens; kv fetched in blocks of `kv` (the block map's
    granularity) and computed in slices of `kv_compute`."""
    q: int
    kv: int
    kv_compute: int


def fits_chunks(chunk_tokens: int | None) -> bool:
    """Whether a sequence stored as contiguous chunks of this many tokens keeps every
    block inside one chunk, as the block map needs."""
    return chunk_tokens is not None and chunk_tokens % _LANES == 0


def _largest_tile(n: int, cap: int) -> int:
    fits = [m for m in range(_LANES, max(cap, _LANES) + 1, _LANES) if n % m == 0]
    if not fits:
        raise ValueError(f"splash attention needs sequence chunks that are multiples of "
                         f"{_LANES} tokens; got a length of {n}")
    return max(fits)


def block_sizes(sq: int, skv: int, block_q: int, block_kv: int,
                run_tokens: int | None = None) -> Blocks:
    """Tiles for sq queries and skv keys made of contiguous runs of `run_tokens` (None:
    one run each): the largest multiples of 128 dividing a run, capped by the requested
    sizes; kv blocks then double (computed in the requested slices) until the block map
    fits `_MAP_ENTRIES`, staying inside a run."""
    q_run, kv_run = (math.gcd(n, run_tokens) if run_tokens else n for n in (sq, skv))
    q, kv_compute = _largest_tile(q_run, block_q), _largest_tile(kv_run, block_kv)
    kv = kv_compute
    while (sq // q) * (skv // kv) > _MAP_ENTRIES and kv_run % (2 * kv) == 0 \
            and 2 * kv <= _MAX_KV_BLOCK:
        kv *= 2
    if (sq // q) * (skv // kv) > _MAP_ENTRIES:
        raise ValueError(
            f"splash attention of {sq} queries x {skv} keys needs a block map of "
            f"{(sq // q) * (skv // kv)} entries with {q} x {kv}-token blocks; at most "
            f"{_MAP_ENTRIES} fit its scalar memory: use attention.impl=pallas (or auto), "
            f"or more context parallelism")
    return Blocks(q, kv, kv_compute)


def supports(sq: int, skv: int, block_q: int, block_kv: int, run_tokens: int | None) -> bool:
    """Whether `block_sizes` finds tiles (what impl=auto asks before picking splash)."""
    try:
        block_sizes(sq, skv, block_q, block_kv, run_tokens)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------- block map ----

def _bounds(x, block):
    blocks = x.reshape(-1, block)
    return blocks.min(-1), blocks.max(-1)


def _block_map(q_pos, kv_pos, q_seg, kv_seg, blocks, causal):
    """(kind, pattern) int32 [nq, nkv] of one row: _EMPTY, _PARTIAL or _FULL per pair of
    blocks, and for a partial pair the index of its diagonal pattern (`_patterns`)."""
    (q_seg_lo, q_seg_hi), (kv_seg_lo, kv_seg_hi) = (_bounds(q_seg, blocks.q),
                                                    _bounds(kv_seg, blocks.kv))
    empty = ~some_segments_shared(q_seg_lo[:, None], q_seg_hi[:, None], kv_seg_lo[None],
                                  kv_seg_hi[None])
    (q_lo, q_hi), (kv_lo, kv_hi) = _bounds(q_pos, blocks.q), _bounds(kv_pos, blocks.kv)
    if not causal:
        return jnp.where(empty, _EMPTY, _FULL), jnp.zeros(empty.shape, jnp.int32)
    q_lo, q_hi = q_lo[:, None], q_hi[:, None]
    empty |= ~some_keys_visible(q_lo, q_hi, kv_lo[None], kv_hi[None], causal=True)
    # Full by position only: splash applies the segment ids inside every visited block.
    full = every_key_visible(q_lo, q_hi, kv_lo[None], kv_hi[None], causal=True)
    kind = jnp.where(empty, _EMPTY, jnp.where(full, _FULL, _PARTIAL))
    step = min(blocks.q, blocks.kv)
    pattern = (kv_lo[None] - q_lo + blocks.kv - step) // step
    return kind, jnp.where(kind == _PARTIAL, pattern, 0)


def _patterns(blocks):
    """bool [n, bq, bkv]: the causal patterns of aligned partial pairs. Pattern p is the
    pair whose kv block starts delta = (p + 1) * step - bkv tokens after the q block
    (step = the smaller block): query row r may see key column t iff r - t >= delta."""
    step = min(blocks.q, blocks.kv)
    count = (blocks.q + blocks.kv) // step - 1
    delta = (jnp.arange(count) + 1) * step - blocks.kv
    r = jnp.arange(blocks.q)[:, None]
    t = jnp.arange(blocks.kv)[None, :]
    return (r - t)[None] >= delta[:, None, None]


def _fetch_order(kinds, axis):
    """For every grid step, the block (index along `axis`) the kernel fetches: the step's
    own block if it is computed, else the last computed one before it (or the first one
    after), so that skipped steps repeat a fetch and Pallas skips the copy."""
    n = kinds.shape[axis]
    index = jax.lax.broadcasted_iota(jnp.int32, kinds.shape, axis)
    computed = kinds != _EMPTY
    last = jax.lax.cummax(jnp.where(computed, index, -1), axis=axis)
    first = jax.lax.cummin(jnp.where(computed, index, n), axis=axis, reverse=True)
    return jnp.where(last >= 0, last, jnp.where(first < n, first, 0))


def _small_int(x, largest):
    return x.astype(jnp.int8 if largest < 2**7 else jnp.int16 if largest < 2**15 else jnp.int32)


def _mask_infos(q_pos, kv_pos, q_seg, kv_seg, blocks, causal):
    """(forward/dq MaskInfo, dk/dv MaskInfo) of one row; arrays [1, nq, nkv] (one map
    shared by all heads). The dk/dv kernel walks q blocks for each kv block, so its
    fetch order runs along q and its patterns are transposed."""
    kind, pattern = _block_map(q_pos, kv_pos, q_seg, kv_seg, blocks, causal)
    patterns = _patterns(blocks)

    def info(fetch_axis, partial_blocks):
        return MaskInfo(
            data_next=_small_int(_fetch_order(kind, fetch_axis), kind.shape[fetch_axis])[None],
            mask_next=_small_int(pattern, len(patterns))[None],
            block_mask=kind.astype(jnp.int8)[None],
            partial_mask_blocks=partial_blocks, q_sequence=None)

    return info(1, patterns), info(0, jnp.swapaxes(patterns, 1, 2))


def _layout_ok(positions, block):
    """True when positions run contiguously through blocks that start at multiples of
    `block`: the layout the stored patterns are exact for."""
    runs = positions.reshape(-1, block)
    starts = runs[:, :1]
    return jnp.all((runs == starts + jnp.arange(block)) & (starts % block == 0))


# ------------------------------------------------------- one row, [h, s, d] ----

_LAYOUTS = dict(q_layout=splash.QKVLayout.HEAD_DIM_MINOR, k_layout=splash.QKVLayout.HEAD_DIM_MINOR,
                v_layout=splash.QKVLayout.HEAD_DIM_MINOR)


def _row_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, blocks, causal, interpret):
    """Splash forward of one row (q [hq, sq, d]); (out, lse [hq, sq]) raw from the kernel."""
    fwd_info, _ = _mask_infos(q_pos, kv_pos, q_seg, kv_seg, blocks, causal)
    sizes = splash.BlockSizes(block_q=blocks.q, block_kv=blocks.kv,
                              block_kv_compute=blocks.kv_compute, **_LAYOUTS)
    out, (lse,) = splash._splash_attention_forward(
        fwd_info, q, k, v, splash.SegmentIds(q_seg, kv_seg), None, mask_value=_MASK_VALUE,
        is_mqa=False, block_sizes=sizes, residual_checkpoint_name=None, save_residuals=True,
        mask_function=None, interpret=interpret)
    ok = _layout_ok(q_pos, blocks.q) & _layout_ok(kv_pos, blocks.kv)
    return jnp.where(ok, out, jnp.nan), lse


def _row_backward(q, k, v, lse, dout, delta, q_pos, kv_pos, q_seg, kv_seg, blocks,
                  causal, interpret):
    """(dq, dk, dv) of one row from splash's dq and dk/dv kernels."""
    fwd_info, dkv_info = _mask_infos(q_pos, kv_pos, q_seg, kv_seg, blocks, causal)
    common = dict(mask_value=_MASK_VALUE, attn_logits_soft_cap=None, is_mqa=False,
                  mask_function=None, interpret=interpret, **_LAYOUTS)
    segments = splash.SegmentIds(q_seg, kv_seg)
    _, dk, dv = splash._splash_attention_bwd_dkv(
        q, k, v, segments, None, lse, dout, delta, bq=blocks.q, bkv=blocks.kv,
        bkv_compute=blocks.kv_compute, mask_info=dkv_info, use_fused_bwd_kernel=False,
        **common)
    dq = splash._splash_attention_bwd_dq(
        q, k, v, segments, None, lse, dout, delta, bq=blocks.q, bkv=blocks.kv,
        mask_info=fwd_info, **common)
    return dq, dk, dv


# ------------------------------------------------------------------ batch ----

def _per_row(fn, *batched):
    """fn over the rows of a batch, one kernel launch per row: every row has its own
    block map (positions and segments differ per row). One row (long-context training's
    usual batch per device) is called directly: inside a loop XLA may give the row's q
    another layout than the kernel reads and copy it back."""
    if batched[0].shape[0] == 1:
        return jax.tree.map(lambda x: x[None], fn(*(x[0] for x in batched)))
    return jax.lax.map(lambda row: fn(*row), batched)


def _without_empty_rows(out, lse):
    """Rows where splash found no allowed key (lse at the mask value, or -inf where no
    block was computed at all) -> out 0, lse -inf, as the other kernels return them."""
    empty = ~(lse > _MASK_VALUE / 2)
    return jnp.where(empty[..., None], 0, out).astype(out.dtype), jnp.where(empty, -jnp.inf, lse)


def _backward_lse(lse):
    """lse for the backward kernels: +inf on empty rows makes their probabilities 0."""
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, blocks, interpret, layout):
    row = functools.partial(_row_forward, blocks=blocks, causal=causal, interpret=interpret)
    out, lse = _per_row(row, *(relayout(x, layout, HEADS_MAJOR) for x in (q, k, v)),
                        q_pos, kv_pos, q_seg, kv_seg)
    out, lse = _without_empty_rows(out, lse)
    return relayout(out, HEADS_MAJOR, layout), lse


def _backward(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal, blocks,
              interpret, layout):
    """(dq, dk, dv) given delta (layout.row_dot of out and dout) minus the lse cotangent:
    d lse / d score = probability, so that cotangent enters exactly like -delta."""
    q, k, v, dout = (relayout(x, layout, HEADS_MAJOR) for x in (q, k, v, dout))
    row = functools.partial(_row_backward, blocks=blocks, causal=causal, interpret=interpret)
    grads = _per_row(row, q, k, v, _backward_lse(lse), dout, delta, q_pos, kv_pos, q_seg,
                     kv_seg)
    return tuple(relayout(g, HEADS_MAJOR, layout) for g in grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _splash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, blocks, interpret, layout):
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, blocks, interpret, layout)


def _splash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, blocks, interpret, layout):
    out, lse = named_results(*_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, blocks,
                                       interpret, layout))
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _splash_bwd(causal, blocks, interpret, layout, residuals, cotangents):
    q, k, v, out, lse, *ids = residuals
    dout, dlse = cotangents
    delta = row_dot(out, dout, layout) - dlse
    dq, dk, dv = _backward(q, k, v, delta, lse, dout, *ids, causal, blocks, interpret, layout)
    return dq, dk, dv, None, None, None, None


_splash.defvjp(_splash_fwd, _splash_bwd)


# ------------------------------------------------------------- public api ----

NO_WINDOW = ("attention.impl=splash has no sliding window (its LocalMask is static, our "
             "block maps are built at run time); use attention.impl=pallas or auto, which "
             "run windowed layers on the Pallas kernel")


def _no_window(window):
    if window is not None:
        raise ValueError(f"{NO_WINDOW}; got window={window}")


def _interpret(platform):
    return (platform or jax.default_backend()) == "cpu"


def _prepare(q, k, ids, block_q, block_kv, run_tokens, layout):
    """(tiles, query scale, int32 ids). Splash expects queries already scaled by
    1/sqrt(d)."""
    blocks = block_sizes(seq_len(q, layout), seq_len(k, layout), block_q, block_kv,
                         run_tokens)
    scale = jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    return blocks, scale, tuple(x.astype(jnp.int32) for x in ids)


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    *, causal=True, window=None, block_q=512, block_kv=512, platform=None,
                    run_tokens=None, layout=TOKENS_MAJOR):
    """Splash attention; (out in q's layout and dtype, lse [b, hq, sq] f32), as
    `lctrain.kernels.attention` documents, for the layouts described above; q and kv
    are made of contiguous runs of `run_tokens` positions (None: one run each).
    `window` must be None (ValueError otherwise: see NO_WINDOW)."""
    _no_window(window)
    ids = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    blocks, scale, ids = _prepare(q, k, ids, block_q, block_kv, run_tokens, layout)
    return _splash(q * scale, k, v, *ids, bool(causal), blocks, _interpret(platform), layout)


def flash_attention_backward(q, k, v, delta, lse, dout, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, *, causal=True, window=None,
                             block_q=512, block_kv=512, platform=None, run_tokens=None,
                             layout=TOKENS_MAJOR):
    """(dq, dk, dv) of attention between q and one kv block, given the rows' FINAL lse
    and delta (layout.row_dot of out and dout; merged over all kv blocks by the caller,
    as ring attention does). `window` must be None."""
    _no_window(window)
    ids = (q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    blocks, scale, ids = _prepare(q, k, ids, block_q, block_kv, run_tokens, layout)
    dq, dk, dv = _backward(q * scale, k, v, delta, lse, dout, *ids, bool(causal), blocks,
                           _interpret(platform), layout)
    return (dq * scale).astype(q.dtype), dk, dv
