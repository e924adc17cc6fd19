"""Next-token cross-entropy from the final hidden states, masked by document."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_loss(hidden: jax.Array, output_weights: jax.Array, targets: jax.Array,
                    loss_mask: jax.Array, z_loss: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Returns (sum of per-token losses, number of counted tokens).

    Sums rather than a mean, so micro-batches and shards add up exactly to the full batch.
    """
    logits = jnp.einsum("bse,ev->bsv", hidden, output_weights.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    log_partition = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    per_token = log_partition - target_logit + z_loss * jnp.square(log_partition)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(per_token * mask), jnp.sum(mask)
