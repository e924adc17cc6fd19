"""Flash attention for NVIDIA GPUs, in Pallas lowered through Triton (attention.impl=triton).

The contract of every kernel (kernels/__init__.py): the mask comes from true positions
and segment ids (kernels/masks.py), so load-balanced chunks, ring steps and packed
documents need nothing special; GQA reads each kv head through the index maps of the
query heads that share it, never repeated in memory; a sliding window; the logsumexp
for the ring's merge; and a block backward that takes the rows' final lse and delta from
outside, as the ring's custom VJP needs.

Blocks that no query of a q block may see are skipped: every loop step reads the key
block's positions and segment ids, and only blocks that pass masks.some_keys_visible
and share a segment pay for their matmuls. Causal attention then does about half the
work, a window about window / block_kv + 1 blocks per row.

Layout [b, s, h, d] (TOKENS_MAJOR): Triton reads a head's rows with a stride. Grids:
forward and dq (q block, batch, query head); dk and dv (kv block, batch, kv head), the
group's query heads unrolled inside, so dk and dv are summed over the group in registers.
On CPU the same kernels run in Pallas' interpret mode, which is how the tests check them.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import xla
from .layout import TOKENS_MAJOR, convert, row_dot
from .masks import pair_allowed, some_keys_visible, some_segments_shared
from .residuals import named_results

# The XLA kernel's finite "minus infinity": `score - running max` stays finite while every
# key seen so far is masked; masked probabilities are zeroed explicitly.
_MASK_VALUE = xla._MASK_VALUE
# Tiles that keep a q block's f32 accumulator and a score block in registers at head dim
# 128 (FlashAttention-2's Triton defaults); smaller where the length needs it.
FORWARD_TILES = (128, 64)
BACKWARD_TILES = (64, 64)
MIN_TILE = 16  # Triton's smallest matmul dimension


def tile(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    size = 1 << (min(n, cap).bit_length() - 1)
    while n % size:
        size //= 2
    return size


def _visible(q_pos, q_seg, kv_pos, kv_seg, causal, window):
    """Whether some pair of the two blocks may be allowed: the block rule of
    kernels/masks.py by position, and the two blocks' segment ranges overlapping."""
    shared = some_segments_shared(q_seg.min(), q_seg.max(), kv_seg.min(), kv_seg.max())
    return shared & some_keys_visible(q_pos.min(), q_pos.max(), kv_pos.min(), kv_pos.max(),
                                      causal, window)


def _scores(q, k, q_pos, q_seg, kv_pos, kv_seg, causal, window, scale):
    """(scaled scores in f32, _MASK_VALUE where masked; the mask) of one block pair."""
    mask = pair_allowed(q_pos[:, None], kv_pos[None, :], q_seg[:, None], kv_seg[None, :],
                        causal, window)
    return jnp.where(mask, plgpu.dot(q, k, trans_b=True) * scale, _MASK_VALUE), mask


def _probabilities(scores, mask, row_max):
    """exp(scores - row_max), exactly zero where masked."""
    return jnp.where(mask, jnp.exp(scores - row_max[:, None]), 0.0)


# --------------------------------------------------------------- forward ----

def _forward_kernel(q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, q_ref, k_ref, v_ref,
                    out_ref, lse_ref, *, causal, window, block_kv, scale):
    q, q_pos, q_seg = q_ref[...], q_pos_ref[...], q_seg_ref[...]

    def step(j, carry):
        kv = pl.ds(j * block_kv, block_kv)
        kv_pos, kv_seg = kv_pos_ref[kv], kv_seg_ref[kv]

        def attend(carry):
            acc, row_max, row_sum = carry
            scores, mask = _scores(q, k_ref[kv, :], q_pos, q_seg, kv_pos, kv_seg, causal,
                                   window, scale)
            new_max = jnp.maximum(row_max, scores.max(axis=-1))
            p = _probabilities(scores, mask, new_max)
            correction = jnp.exp(row_max - new_max)
            acc = acc * correction[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[kv, :])
            return acc, new_max, row_sum * correction + p.sum(axis=-1)

        return lax.cond(_visible(q_pos, q_seg, kv_pos, kv_seg, causal, window),
                        attend, lambda carry: carry, carry)

    rows = q.shape[0]
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, row_max, row_sum = lax.fori_loop(0, k_ref.shape[0] // block_kv, step, init)
    empty = row_sum == 0.0  # no allowed key: out 0, lse -inf
    out_ref[...] = (acc / jnp.where(empty, 1.0, row_sum)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, row_max + jnp.log(row_sum))


def _id_specs(block, whole):
    """Positions and segment ids, twice each: the grid's block of one side, and the
    other side's whole length (the kernel loops over it), per batch row."""
    blocked = pl.BlockSpec((None, block), lambda i, row, head: (row, i))
    full = pl.BlockSpec((None, whole), lambda i, row, head: (row, 0))
    return [blocked, blocked, full, full]


def _query_grid_specs(block_q, skv, d, group):
    """BlockSpecs on a (q block, batch row, query head) grid: the block's rows of a
    q-shaped array, the whole k or v of the head's kv head, the block's row statistics."""
    rows = pl.BlockSpec((None, block_q, None, d), lambda i, row, head: (row, i, head, 0))
    keys = pl.BlockSpec((None, skv, None, d), lambda i, row, head: (row, 0, head // group, 0))
    stats = pl.BlockSpec((None, None, block_q), lambda i, row, head: (row, head, i))
    return rows, keys, stats


def _compiler_params(d):
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, interpret):
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    block_q, block_kv = tile(sq, FORWARD_TILES[0]), tile(skv, FORWARD_TILES[1])
    kernel = functools.partial(_forward_kernel, causal=causal, window=window,
                               block_kv=block_kv, scale=1.0 / math.sqrt(d))
    rows, keys, stats = _query_grid_specs(block_q, skv, d, group)
    return pl.pallas_call(
        kernel, grid=(sq // block_q, b, hq),
        in_specs=[*_id_specs(block_q, skv), rows, keys, keys],
        out_specs=[rows, stats],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)],
        compiler_params=_compiler_params(d), interpret=interpret, name="lctrain_triton_fwd",
    )(q_pos, q_seg, kv_pos, kv_seg, q, k, v)


# -------------------------------------------------------------- backward ----

def _dq_kernel(q_pos_ref, q_seg_ref, kv_pos_ref, kv_seg_ref, q_ref, k_ref, v_ref, dout_ref,
               lse_ref, delta_ref, dq_ref, *, causal, window, block_kv, scale):
    q, dout, q_pos, q_seg = q_ref[...], dout_ref[...], q_pos_ref[...], q_seg_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def step(j, dq):
        kv = pl.ds(j * block_kv, block_kv)
        kv_pos, kv_seg = kv_pos_ref[kv], kv_seg_ref[kv]

        def attend(dq):
            k, v = k_ref[kv, :], v_ref[kv, :]
            p = _probabilities(*_scores(q, k, q_pos, q_seg, kv_pos, kv_seg, causal, window,
                                        scale), lse)
            ds = p * (plgpu.dot(dout, v, trans_b=True) - delta[:, None])
            return dq + plgpu.dot(ds.astype(k.dtype), k)

        return lax.cond(_visible(q_pos, q_seg, kv_pos, kv_seg, causal, window),
                        attend, lambda dq: dq, dq)

    dq = lax.fori_loop(0, k_ref.shape[0] // block_kv, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(kv_pos_ref, kv_seg_ref, q_pos_ref, q_seg_ref, k_ref, v_ref, q_ref, dout_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, causal, window, block_q, group, scale):
    k, v, kv_pos, kv_seg = k_ref[...], v_ref[...], kv_pos_ref[...], kv_seg_ref[...]

    def step(member, i, carry):
        rows = pl.ds(i * block_q, block_q)
        q_pos, q_seg = q_pos_ref[rows], q_seg_ref[rows]

        def attend(carry):
            dk, dv = carry
            q, dout = q_ref[rows, member, :], dout_ref[rows, member, :]
            p = _probabilities(*_scores(q, k, q_pos, q_seg, kv_pos, kv_seg, causal, window,
                                        scale), lse_ref[member, rows])
            dv = dv + plgpu.dot(p.astype(dout.dtype), dout, trans_a=True)
            ds = p * (plgpu.dot(dout, v, trans_b=True) - delta_ref[member, rows][:, None])
            return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

        return lax.cond(_visible(q_pos, q_seg, kv_pos, kv_seg, causal, window),
                        attend, lambda carry: carry, carry)

    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for member in range(group):  # static: one loop per query head of the group
        carry = lax.fori_loop(0, q_ref.shape[0] // block_q,
                              functools.partial(step, member), carry)
    dk_ref[...] = (carry[0] * scale).astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)


def _grads(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal, window,
           interpret):
    """(dq, dk, dv) given the rows' final lse and delta (the softmax-Jacobian term minus
    any lse cotangent), as kernels/xla._grads."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    block_q, block_kv = tile(sq, BACKWARD_TILES[0]), tile(skv, BACKWARD_TILES[1])
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # empty rows: any finite value, p is 0
    options = dict(causal=causal, window=window, scale=1.0 / math.sqrt(d))
    params = dict(compiler_params=_compiler_params(d), interpret=interpret)

    rows, keys, stats = _query_grid_specs(block_q, skv, d, group)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_kv=block_kv, **options), grid=(sq // block_q, b, hq),
        in_specs=[*_id_specs(block_q, skv), rows, keys, keys, rows, stats, stats],
        out_specs=rows, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="lctrain_triton_dq", **params,
    )(q_pos, q_seg, kv_pos, kv_seg, q, k, v, dout, lse, delta)

    key_block = pl.BlockSpec((None, block_kv, None, d), lambda j, row, head: (row, j, head, 0))
    group_rows = pl.BlockSpec((None, sq, group, d), lambda j, row, head: (row, 0, head, 0))
    group_stats = pl.BlockSpec((None, group, sq), lambda j, row, head: (row, head, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=block_q, group=group, **options),
        grid=(skv // block_kv, b, hkv),
        in_specs=[*_id_specs(block_kv, sq), key_block, key_block, group_rows, group_rows,
                  group_stats, group_stats],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="lctrain_triton_dkv", **params,
    )(kv_pos, kv_seg, q_pos, q_seg, k, v, q, dout, lse, delta)
    return dq, dk, dv


# ------------------------------------------------------------ custom VJP ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, interpret):
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, interpret)


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, interpret):
    out, lse = named_results(*_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window,
                                       interpret))
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


def _flash_bwd(causal, window, interpret, residuals, cotangents):
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    dout, dlse = cotangents
    delta = row_dot(out, dout, TOKENS_MAJOR) - dlse.astype(jnp.float32)
    return (*_grads(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal, window,
                    interpret),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _interpret(platform):
    return (platform or jax.default_backend()) != "gpu"


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    *, causal=True, window=None, block_q=512, block_kv=512, platform=None,
                    layout=TOKENS_MAJOR):
    """(out in q's layout and dtype, lse [b, hq, sq] f32). The tiles are this kernel's
    own (FORWARD_TILES, BACKWARD_TILES: what a GPU's registers hold), so `block_q` and
    `block_kv`, sized for TPU VMEM, are not used. Off a GPU it runs interpreted."""
    q, k, v = (convert(x, layout, TOKENS_MAJOR) for x in (q, k, v))
    out, lse = _flash(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                      bool(causal), window, _interpret(platform))
    return convert(out, TOKENS_MAJOR, layout), lse


def flash_attention_backward(q, k, v, delta, lse, dout, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, *, causal=True, window=None,
                             block_q=512, block_kv=512, platform=None, layout=TOKENS_MAJOR):
    """dq, dk, dv of one (q, kv) block pair given the rows' final lse and delta, for the
    ring's backward (kernels/xla.flash_attention_backward has the same contract)."""
    q, k, v, dout = (convert(x, layout, TOKENS_MAJOR) for x in (q, k, v, dout))
    grads = _grads(q, k, v, delta, lse, dout, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, bool(causal), window, _interpret(platform))
    return tuple(convert(g, TOKENS_MAJOR, layout) for g in grads)
