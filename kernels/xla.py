"""Blockwise (flash) attention in pure JAX with a memory-efficient custom VJP.

Layout inside this module: query heads are grouped by the kv head they share,
q [b, s, hkv, g, d] with g = hq // hkv (query head i = kv head i // g, group
member i % g), so GQA never materializes repeated k/v. Per-row statistics
(lse, running max/sum, delta) live as [b, hkv, g, s].

Forward: for each query block, a `lax.scan` over kv blocks keeps an online
softmax (running max m, running sum l, f32 accumulator). Only q, k, v, out,
lse (plus the int position/segment arrays the mask is rebuilt from) are saved
for the backward pass, so memory is O(s), never O(s^2).

Backward: for each query block, a scan over kv blocks recomputes the scores
and probabilities from the saved lse, accumulates dq in the carry and emits
dk, dv per kv block; an outer scan over query blocks sums those into dk, dv.
Working memory per step is O(b * hq * block_q * block_kv).

Masking uses a large finite score plus explicit zeroing of probabilities, so
no exp(-inf - -inf) ever happens: rows with no allowed key give out = 0,
lse = -inf and zero (finite) gradients.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .layout import TOKENS_MAJOR, convert, row_dot
from .masks import attention_mask
from .residuals import named_results

# Score given to disallowed pairs. Finite, so `s - running_max` stays finite
# even while every key seen so far is masked (then both equal this value);
# not finfo.min, so differences of such values cannot overflow. Probabilities
# of masked pairs are zeroed explicitly, so the value itself never leaks.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_F32 = jnp.float32


def largest_divisor_at_most(n: int, cap: int) -> int:
    """Block size actually used: the largest divisor of n that is <= cap.

    Scans need equal blocks; picking a divisor avoids padding (a prime length
    degrades to block 1, correct but slow, so choose lengths with care).
    """
    for size in range(max(1, min(n, cap)), 0, -1):
        if n % size == 0:
            return size
    raise ValueError(f"cannot block a length of {n}")


# ---------------------------------------------------------------- layout ----

def _split_blocks(x, block):
    """[b, s, ...] -> [s // block, b, block, ...]: the scanned axis leads."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _merge_blocks(x):
    """Inverse of `_split_blocks`: [n, b, block, ...] -> [b, n * block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _split_rows(x, hkv, block):
    """Per-row statistic [b, hq, s] -> [s // block, b, hkv, g, block]."""
    b, hq, s = x.shape
    x = x.reshape(b, hkv, hq // hkv, s // block, block)
    return jnp.moveaxis(x, 3, 0)


def _merge_rows(x):
    """Inverse of `_split_rows`: [n, b, hkv, g, block] -> [b, hq, n * block]."""
    n, b, hkv, g, block = x.shape
    return jnp.moveaxis(x, 0, 3).reshape(b, hkv * g, n * block)


# ------------------------------------------------------------------ math ----

def _scores(q, k, scale):
    """Scaled logits q.k / sqrt(d) for one block pair: [b, hkv, g, bq, bk], f32."""
    return jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=_F32) * scale


def _block_mask(k, q_pos, kv_pos, q_seg, kv_seg, causal, window):
    """Allowed pairs for one block pair, broadcast over (hkv, g): [b, 1, 1, bq, bk].

    Positions and segments are the same in every layer, so XLA would hoist all blocks'
    masks out of the layer loop and keep them: O(s^2) bytes. Tying them to this block's
    keys (which differ per layer) through an optimization barrier keeps each mask inside
    its block step, O(bq * bk).
    """
    _, q_pos, kv_pos, q_seg, kv_seg = jax.lax.optimization_barrier(
        (k, q_pos, kv_pos, q_seg, kv_seg))
    return attention_mask(q_pos, kv_pos, q_seg, kv_seg, causal, window)[:, None, None]


def _masked_scores(q, k, mask, scale):
    return jnp.where(mask, _scores(q, k, scale), _MASK_VALUE)


def _masked_probs(scores, mask, row_max):
    """exp(scores - row_max) on allowed pairs, exactly 0 on the rest.

    The `where` matters when every pair in a row is masked: there
    scores == row_max == _MASK_VALUE and exp(0) = 1 would count masked keys.
    """
    return jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0.0)


def _weighted_values(p, v):
    """sum_k p[q, k] v[k] -> [b, hkv, g, bq, d] in f32.

    p is cast to v's dtype so bf16 inputs run a bf16 matmul (as fused flash
    kernels do); accumulation is f32 either way.
    """
    return jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v,
                      preferred_element_type=_F32)


def _online_softmax_step(carry, kv_block, *, q, q_pos, q_seg, causal, window, scale):
    """Fold one kv block into the running (acc, max, sum) of a query block."""
    acc, row_max, row_sum = carry
    k, v, kv_pos, kv_seg = kv_block
    mask = _block_mask(k, q_pos, kv_pos, q_seg, kv_seg, causal, window)
    s = _masked_scores(q, k, mask, scale)
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    # What was accumulated was weighted by exp(. - row_max); rescale it to the
    # new max. Both maxima are finite, and new_max >= row_max, so this is <= 1.
    correction = jnp.exp(row_max - new_max)
    p = _masked_probs(s, mask, new_max)
    row_sum = row_sum * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + _weighted_values(p, v)
    return (acc, new_max, row_sum), None


def _normalize(acc, row_max, row_sum):
    """Final out = acc / l and lse = m + log l; rows with no allowed key -> 0, -inf.

    A row with at least one allowed key has row_sum >= 1 (its maximum
    contributes exp(0)), so `row_sum > 0` exactly identifies non-empty rows.
    """
    has_keys = row_sum > 0
    safe_sum = jnp.where(has_keys, row_sum, 1.0)
    out = acc / safe_sum[..., None]  # acc is already 0 on empty rows
    lse = jnp.where(has_keys, row_max + jnp.log(safe_sum), -jnp.inf)
    return out, lse


def _attention_grads_step(dq, kv_block, *, q, dout, lse, delta, q_pos, q_seg, causal,
                          window, scale):
    """One kv block of the backward pass for one query block.

    With p = softmax probs, o = p v, lse = logsumexp(s):
      dv = p^T do,   dp = do v^T,
      ds = p * (dp - delta)   (delta = rowsum(do * o) - dlse; d lse/ds = p),
      dq += scale * ds k,   dk = scale * ds^T q.
    Summing over the group axis g in dk, dv is the GQA reduction.
    """
    k, v, kv_pos, kv_seg = kv_block
    mask = _block_mask(k, q_pos, kv_pos, q_seg, kv_seg, causal, window)
    s = _masked_scores(q, k, mask, scale)
    p = _masked_probs(s, mask, lse)  # exact softmax probs, recomputed from lse
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(dout.dtype), dout,
                    preferred_element_type=_F32)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dout, v, preferred_element_type=_F32)
    ds = p * (dp - delta[..., None])
    dq = dq + scale * jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k,
                                 preferred_element_type=_F32)
    dk = scale * jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q,
                            preferred_element_type=_F32)
    return dq, (dk, dv)


# ---------------------------------------------------------- fwd and bwd ----

def _group_heads(x, hkv):
    """[b, s, hq, d] -> [b, s, hkv, g, d]; query head i -> (i // g, i % g)."""
    b, s, hq, d = x.shape
    return x.reshape(b, s, hkv, hq // hkv, d)


def _kv_blocks(k, v, kv_pos, kv_seg, block_kv):
    return tuple(_split_blocks(x, block_kv) for x in (k, v, kv_pos, kv_seg))


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv):
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    kv_blocks = _kv_blocks(k, v, kv_pos, kv_seg, block_kv)

    def one_query_block(args):
        qb, qb_pos, qb_seg = args
        init = (jnp.zeros((b, hkv, g, block_q, d), _F32),
                jnp.full((b, hkv, g, block_q), _MASK_VALUE, _F32),
                jnp.zeros((b, hkv, g, block_q), _F32))
        step = functools.partial(_online_softmax_step, q=qb, q_pos=qb_pos, q_seg=qb_seg,
                                 causal=causal, window=window, scale=scale)
        (acc, row_max, row_sum), _ = lax.scan(step, init, kv_blocks)
        out, lse = _normalize(acc, row_max, row_sum)
        # [b, hkv, g, bq, d] -> [b, bq, hkv, g, d], back in the caller's dtype.
        return jnp.moveaxis(out, 3, 1).astype(q.dtype), lse

    # Query blocks are independent in the forward pass: map over them.
    q_blocks = tuple(_split_blocks(x, block_q)
                     for x in (_group_heads(q, hkv), q_pos, q_seg))
    out, lse = lax.map(one_query_block, q_blocks)
    return _merge_blocks(out).reshape(b, sq, hq, d), _merge_rows(lse)


def _backward(causal, window, block_q, block_kv, residuals, cotangents):
    q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg = residuals
    dout, dlse = cotangents
    delta = row_dot(out, dout, TOKENS_MAJOR) - dlse.astype(_F32)
    return (*_grads(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal, window,
                    block_q, block_kv),
            None, None, None, None)  # positions and segment ids are integers: no cotangent


def _grads(q, k, v, delta, lse, dout, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q,
           block_kv):
    """(dq, dk, dv) given delta, the rows' softmax-Jacobian term (kernels/layout.row_dot)
    minus the lse cotangent."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    # Empty rows have lse = -inf; any finite stand-in works, their p is 0.
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

    kv_blocks = _kv_blocks(k, v, kv_pos, kv_seg, block_kv)
    q_blocks = (
        *(_split_blocks(_group_heads(x, hkv), block_q) for x in (q, dout)),
        *(_split_rows(x, hkv, block_q) for x in (lse, delta)),
        *(_split_blocks(x, block_q) for x in (q_pos, q_seg)),
    )

    def one_query_block(dkv_acc, q_block):
        qb, doutb, lseb, deltab, qb_pos, qb_seg = q_block
        step = functools.partial(_attention_grads_step, q=qb, dout=doutb, lse=lseb,
                                 delta=deltab, q_pos=qb_pos, q_seg=qb_seg,
                                 causal=causal, window=window, scale=scale)
        dq, dkv = lax.scan(step, jnp.zeros(qb.shape, _F32), kv_blocks)
        # dk, dv of every kv block get a contribution from every query block.
        return jax.tree.map(jnp.add, dkv_acc, dkv), dq

    dkv_init = tuple(jnp.zeros(x.shape, _F32) for x in kv_blocks[:2])
    (dk, dv), dq = lax.scan(one_query_block, dkv_init, q_blocks)
    dq = _merge_blocks(dq).reshape(q.shape).astype(q.dtype)
    dk = _merge_blocks(dk).astype(k.dtype)
    dv = _merge_blocks(dv).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv):
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv)


def _flash_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window, block_q, block_kv):
    out, lse = named_results(*_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal,
                                       window, block_q, block_kv))
    # O(s) residuals only; the backward recomputes scores block by block.
    return (out, lse), (q, k, v, out, lse, q_pos, kv_pos, q_seg, kv_seg)


_flash.defvjp(_flash_fwd, _backward)


def flash_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    *, causal=True, window=None, block_q=512, block_kv=512, platform=None,
                    layout=TOKENS_MAJOR):
    """Blockwise attention; returns (out in q's layout and dtype, lse [b, hq, sq] f32).

    Block sizes are rounded down to divisors of sq / skv. Shapes are assumed
    validated by `lctrain.kernels.attention`. `platform` is unused: plain XLA runs on
    every platform (it is part of every kernel's signature). This kernel computes in
    [b, s, h, d]; another `layout` is swapped on the way in and out. `window`
    (kernels/masks.py) is applied by the mask: this kernel skips no block, causal or
    windowed.
    """
    q, k, v = (convert(x, layout, TOKENS_MAJOR) for x in (q, k, v))
    block_q = largest_divisor_at_most(q.shape[1], block_q)
    block_kv = largest_divisor_at_most(k.shape[1], block_kv)
    out, lse = _flash(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                      bool(causal), window, block_q, block_kv)
    return convert(out, TOKENS_MAJOR, layout), lse


def flash_attention_backward(q, k, v, delta, lse, dout, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, *, causal=True, window=None,
                             block_q=512, block_kv=512, platform=None, layout=TOKENS_MAJOR):
    """dq, dk, dv of one (q, kv) block pair given the rows' FINAL lse and delta
    (kernels/layout.row_dot of their final out and dout).

    A ring step calls this with the lse merged over all kv blocks: then
    p = exp(s - lse) is this block's share of the global softmax, and the result is
    exactly this block's contribution to the gradients.
    """
    q, k, v, dout = (convert(x, layout, TOKENS_MAJOR) for x in (q, k, v, dout))
    block_q = largest_divisor_at_most(q.shape[1], block_q)
    block_kv = largest_divisor_at_most(k.shape[1], block_kv)
    grads = _grads(q, k, v, delta, lse, dout, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, bool(causal), window, block_q, block_kv)
    return tuple(convert(g, TOKENS_MAJOR, layout) for g in grads)
