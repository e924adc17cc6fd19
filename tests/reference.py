"""Ground-truth attention: the obvious O(s^2) computation in float32.

Every kernel and every context-parallel strategy is tested against
`dense_attention`. It deliberately shares no code with the kernels (the mask
is rebuilt here too) and uses HIGHEST matmul precision so it stays exact f32
on accelerators whose default f32 matmul is reduced precision.

It is differentiable and NaN-free, including rows with no allowed key.
"""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def dense_attention(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    causal=True, window=None):
    """Returns (out [b, sq, hq, d] f32, lse [b, hq, sq] f32).

    q: [b, sq, hq, d]; k, v: [b, skv, hkv, d]; query head i uses kv head
    i // (hq // hkv). Query i attends key j iff the segment ids match and (if
    causal) q_positions[i] >= kv_positions[j] and (with a sliding window)
    q_positions[i] - kv_positions[j] < window. Rows with no allowed key:
    out = 0, lse = -inf.
    """
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)

    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) / jnp.sqrt(q.shape[-1])

    allowed = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if causal:
        allowed = allowed & (q_positions[:, :, None] >= kv_positions[:, None, :])
    if window is not None:
        allowed = allowed & (q_positions[:, :, None] - kv_positions[:, None, :] < window)
    allowed = allowed[:, None]  # [b, 1, sq, skv], broadcast over heads

    # Softmax written out so that empty rows give 0 / -inf with zero gradients.
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    nonempty = total > 0
    safe_total = jnp.where(nonempty, total, 1.0)

    probs = weights / safe_total
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=_HIGHEST)
    lse = jnp.where(nonempty, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
    return out, lse


def merge_partials(parts):
    """Attention results over disjoint key chunks, [(out, lse), ...], merged into the
    result over all keys by their logsumexps (what ring attention does)."""
    lses = jnp.stack([lse for _, lse in parts])  # [chunk, b, hq, sq]
    lse = jax.nn.logsumexp(lses, axis=0)
    weights = jnp.moveaxis(jnp.exp(lses - lse), 2, 3)[..., None]  # [chunk, b, sq, hq, 1]
    return sum(out * w for (out, _), w in zip(parts, weights)), lse
