"""ring: K/V travel around the chips of the context axis while each chip attends its queries.

Step t of c: chip i holds the K/V chunk of chip i-t, attends its own queries to it, and
folds the partial result into a running (out, logsumexp). The next chunk is sent on
before the local work starts, so XLA can overlap the transfer with the compute.

The backward pass is written by hand (custom VJP) so that memory stays O(s/c): the
forward keeps only q, k, v, out and logsumexp; the backward rotates K/V once more,
recomputes each step's gradients from the final out/logsumexp, and sends the dK/dV
accumulators around the ring with their K/V, so after c steps they are back home.
Steps with nothing to attend (a chunk entirely in the causal future) are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lctrain import kernels
from lctrain.kernels.residuals import named_results
from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy
from lctrain.recipes.schema import Recipe


class Ring(ContextStrategy):
    name = "ring"

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        """A ring step: the device's chunk against another device's."""
        return (recipe.data.seq_len // axis_sizes["context"],) * 2

    def local_attention(self, q, k, v, positions, segment_ids):
        return ring_attention(q, k, v, positions, segment_ids, CONTEXT_AXIS,
                              tuple(sorted(self.kernel_options.items())))


def ring_attention(q, k, v, positions, segment_ids, axis_name, kernel_options):
    """Causal attention of the local queries to the whole sequence spread over `axis_name`.

    `kernel_options` is a sorted tuple of (name, value) for `lctrain.kernels` (hashable,
    because it is a static argument of the custom VJP).
    """
    return _ring(q, k, v, positions, segment_ids, axis_name, kernel_options)


def _send_to_next(x, axis_name):
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, perm=[(i, (i + 1) % size) for i in range(size)])


def _may_attend(q_positions, kv_positions):
    """False only when every key of the chunk lies in the causal future of every query."""
    return jnp.max(q_positions) >= jnp.min(kv_positions)


def _merge(out, lse, block_out, block_lse):
    """Combines two softmax-normalised partial results by their logsumexps."""
    new_lse = jnp.logaddexp(lse, block_lse)
    finite = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)  # rows with no key at all yet

    def weight(x):  # [b, h, s] -> [b, s, h, 1] to scale out
        return jnp.exp(x - finite).transpose(0, 2, 1)[..., None]

    return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), new_lse


def _tied(tensors):
    """The tensors, made to look to XLA as if each depended on all the others.

    Positions and segment ids are the same in every layer; anything computed from them
    alone (which ring steps to skip, the kernel's masks) XLA would hoist out of the layer
    loop and keep for every ring step at once. Tied to the layer's K/V they stay in it.
    """
    return jax.lax.optimization_barrier(tensors)


def _forward(q, k, v, positions, segment_ids, axis_name, kernel_options):
    options = dict(kernel_options)
    b, s, h, d = q.shape
    q, positions, segment_ids = _tied((q, positions, segment_ids))

    def attend_and_merge(out, lse, k, v, kv_positions, kv_segment_ids):
        block = kernels.attention(q, k, v, q_positions=positions, kv_positions=kv_positions,
                                  q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                  causal=True, return_lse=True, **options)
        return _merge(out, lse, *block)

    def skip(out, lse, *_):
        return out, lse

    def step(carry, _):
        out, lse, kv = carry
        kv = _tied(kv)
        next_kv = tuple(_send_to_next(x, axis_name) for x in kv)
        # The skipped branch hands the running result through: a branch that made a
        # constant block (zeros, -inf) would be hoisted out of the layer loop by XLA, one
        # q-sized buffer per ring step kept for the whole step.
        out, lse = jax.lax.cond(_may_attend(positions, kv[2]), attend_and_merge, skip,
                                out, lse, *kv)
        return (out, lse, next_kv), None

    init = (jnp.zeros((b, s, h, d), jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32),
            (k, v, positions, segment_ids))
    (out, lse, _), _ = jax.lax.scan(step, init, length=jax.lax.axis_size(axis_name))
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, positions, segment_ids, axis_name, kernel_options):
    return _forward(q, k, v, positions, segment_ids, axis_name, kernel_options)[0]


def _ring_fwd(q, k, v, positions, segment_ids, axis_name, kernel_options):
    out, lse = named_results(*_forward(q, k, v, positions, segment_ids, axis_name,
                                       kernel_options))
    return out, (q, k, v, positions, segment_ids, out, lse)


def _ring_bwd(axis_name, kernel_options, residuals, dout):
    q, k, v, positions, segment_ids, out, lse = residuals
    options = dict(kernel_options)

    def accumulate(dq, dk, dv, k, v, kv_positions, kv_segment_ids):
        block_dq, block_dk, block_dv = kernels.attention_block_backward(
            q, k, v, out, lse, dout, q_positions=positions, kv_positions=kv_positions,
            q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, causal=True, **options)
        return (dq + block_dq.astype(jnp.float32), dk + block_dk.astype(jnp.float32),
                dv + block_dv.astype(jnp.float32))

    def skip(dq, dk, dv, *_):
        return dq, dk, dv

    def step(carry, _):
        dq, kv, dk, dv = carry
        dq, dk, dv = jax.lax.cond(_may_attend(positions, kv[2]), accumulate, skip,
                                  dq, dk, dv, *kv)
        # dK/dV travel with their K/V: after the last step both are back on their owner.
        moved = tuple(_send_to_next(x, axis_name) for x in (*kv, dk, dv))
        return (dq, moved[:4], *moved[4:]), None

    init = (jnp.zeros(q.shape, jnp.float32), (k, v, positions, segment_ids),
            jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dq, _, dk, dv), _ = jax.lax.scan(step, init, length=jax.lax.axis_size(axis_name))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
