"""Next-token cross-entropy from the final hidden states, masked by document.

At long context the logits are the largest tensor of the whole step (128K tokens x 128,256
vocabulary x 4 bytes = 67 GB per chip), so by default they never exist whole: the sequence
is cut into chunks and a `lax.scan` computes one chunk's logits at a time; a custom VJP
recomputes each chunk's logits in backward instead of keeping them from forward. Forward
and backward hold one chunk of logits at a time.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lctrain.parallel.token_chunks import TokenChunks, resolve_chunk_tokens
from lctrain.recipes.schema import LossConfig


class LossAux(NamedTuple):
    """What the loss reports beside its sum: counted tokens, and the z-loss part of the sum
    (so cross-entropy = sum - z_loss is logged apart from the regulariser)."""
    tokens: jax.Array
    z_loss: jax.Array


def next_token_loss(hidden: jax.Array, output_weights: jax.Array, targets: jax.Array,
                    loss_mask: jax.Array, z_loss: float = 0.0,
                    config: LossConfig | None = None, sequence_shards: int = 1
                    ) -> tuple[jax.Array, LossAux]:
    """Returns (sum of per-token losses, LossAux(counted tokens, z-loss part of the sum)).

    hidden [b, s, e] and output_weights [e, v] give the logits; targets and loss_mask are
    [b, s]. Each counted token adds logsumexp - target logit + z_loss * logsumexp^2.
    Sums rather than a mean, so micro-batches and shards add up exactly to the full batch.
    `config` (the recipe's `loss` section; default: LossConfig()) picks the chunk size;
    `sequence_shards` is how many devices the sequence is split over (mesh.context), so
    every chunk takes its tokens evenly from all of them.
    """
    config = config or LossConfig()
    chunk_tokens = resolve_chunk_tokens(config.chunk_tokens, hidden.shape[1])
    if chunk_tokens == hidden.shape[1]:
        per_token, log_partition = _per_token_loss(
            hidden, output_weights.astype(hidden.dtype), targets, z_loss)
    else:
        per_token, log_partition, loss_mask = _chunked_per_token_loss(
            hidden, output_weights, targets, loss_mask, z_loss, chunk_tokens, sequence_shards)
    mask = loss_mask.astype(jnp.float32)
    z_part = z_loss * jnp.sum(jnp.square(jax.lax.stop_gradient(log_partition)) * mask)
    return jnp.sum(per_token * mask), LossAux(jnp.sum(mask), z_part)


def _logits_and_log_partition(hidden: jax.Array, output_weights: jax.Array
                              ) -> tuple[jax.Array, jax.Array]:
    """The f32 logits [..., s, v] and their logsumexp [..., s, 1]."""
    logits = _logits(hidden, output_weights)
    return logits, jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def _logits(hidden: jax.Array, output_weights: jax.Array) -> jax.Array:
    return jnp.einsum("...se,ev->...sv", hidden, output_weights,
                      preferred_element_type=jnp.float32)


def _per_token_loss(hidden: jax.Array, output_weights: jax.Array, targets: jax.Array,
                    z_loss: float) -> tuple[jax.Array, jax.Array]:
    """Unmasked loss of every token [..., s], and its logsumexp [..., s]."""
    logits, log_partition = _logits_and_log_partition(hidden, output_weights)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    loss = log_partition - target_logit + z_loss * jnp.square(log_partition)
    return loss[..., 0], log_partition[..., 0]


def token_scores(hidden: jax.Array, output_weights: jax.Array, targets: jax.Array,
                 config: LossConfig | None = None, sequence_shards: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
    """Forward only: each token's cross-entropy (no z-loss) and whether its target is the
    argmax, both [b, s] float32, the logits one chunk at a time as in next_token_loss."""
    config = config or LossConfig()
    output_weights = output_weights.astype(hidden.dtype)

    def scores(chunk_hidden, chunk_targets):
        logits, log_partition = _logits_and_log_partition(chunk_hidden, output_weights)
        target_logit = jnp.take_along_axis(logits, chunk_targets[..., None], axis=-1)
        correct = jnp.argmax(logits, axis=-1) == chunk_targets
        return (log_partition - target_logit)[..., 0], correct.astype(jnp.float32)

    chunk_tokens = resolve_chunk_tokens(config.chunk_tokens, hidden.shape[1])
    if chunk_tokens == hidden.shape[1]:
        return scores(hidden, targets)
    chunks = TokenChunks(targets.shape[1], chunk_tokens, sequence_shards)
    losses, correct = jax.lax.map(lambda chunk: scores(*chunk),
                                  (chunks.split(hidden), chunks.split(targets)))
    return chunks.merge(losses), chunks.merge(correct)


def _chunked_per_token_loss(hidden, output_weights, targets, loss_mask, z_loss,
                            chunk_tokens: int, shards: int):
    """Per-token losses, their logsumexp and the mask, each [n_chunks, b, chunk_len], one
    chunk at a time (chunks as parallel/token_chunks.py cuts them: each spread over all
    `shards`)."""
    chunks = TokenChunks(targets.shape[1], chunk_tokens, shards)
    per_token, log_partition = _chunk_losses(hidden, output_weights.astype(hidden.dtype),
                                             targets, z_loss, chunks)
    # Padding gets mask 0 (and target 0, a valid index), so it adds nothing to loss or grads.
    return per_token, log_partition, chunks.split(loss_mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunk_losses(hidden, output_weights, targets, z_loss, chunks: TokenChunks):
    """[n, b, t] per-token losses and logsumexps, `chunks` of [b, s, e] hidden one chunk's
    logits at a time. The backward recomputes each chunk's logits (it keeps the inputs,
    unsplit, and the logsumexps) and sums the output weights' gradient over the chunks in
    float32, rounding the total once to the compute dtype: differentiating the scan would
    round at every chunk.
    The logsumexps are reported for the z-loss metric only: their cotangent is ignored."""
    def chunk_loss(carry, chunk):
        chunk_hidden, chunk_targets = chunk
        return carry, _per_token_loss(chunk_hidden, output_weights, chunk_targets, z_loss)

    return jax.lax.scan(chunk_loss, None, (chunks.split(hidden), chunks.split(targets)))[1]


def _chunk_losses_forward(hidden, output_weights, targets, z_loss, chunks):
    per_token, log_partition = _chunk_losses(hidden, output_weights, targets, z_loss, chunks)
    # The backward takes the logsumexps (4 bytes a token) rather than recomputing them.
    # That also makes it wait for this scan: with nothing downstream needing the loss
    # itself, XLA scheduled the scan last, holding the final hidden states (2 GiB per chip
    # for llama3.1-8b at 256K tokens per chip) through the layers' whole backward
    # (benchmarks/RESULTS.md, "llama3.1-8b on 4 v5p chips, against MaxText").
    return (per_token, log_partition), (hidden, output_weights, targets, log_partition)


def _chunk_losses_backward(z_loss, chunks, residuals, output_grads):
    hidden, output_weights, targets, log_partitions = residuals
    per_token_grads, _ = output_grads
    dtype = hidden.dtype

    def chunk_grads(weights_grad, chunk):
        chunk_hidden, chunk_targets, log_partition, grads = chunk
        log_partition = log_partition[..., None]
        logits = _logits(chunk_hidden, output_weights)
        # d(lse - target logit + z lse^2) / d logits = softmax (1 + 2 z lse) - one_hot
        scale = grads[..., None] * (1 + 2 * z_loss * log_partition)
        logits_grad = (jnp.exp(logits - log_partition) * scale
                       - grads[..., None] * jax.nn.one_hot(chunk_targets, logits.shape[-1]))
        logits_grad = logits_grad.astype(dtype)
        hidden_grad = jnp.einsum("btv,ev->bte", logits_grad, output_weights,
                                 preferred_element_type=jnp.float32).astype(dtype)
        # One chunk's gradient leaves the matmul in the compute dtype (a sharded sequence
        # reduces it over the devices per chunk at that size) and is summed in float32.
        chunk_weights_grad = jnp.einsum("bte,btv->ev", chunk_hidden, logits_grad)
        return weights_grad + chunk_weights_grad.astype(jnp.float32), hidden_grad

    zeros = jnp.zeros(output_weights.shape, jnp.float32)
    weights_grad, hidden_grads = jax.lax.scan(
        chunk_grads, zeros,
        (chunks.split(hidden), chunks.split(targets), log_partitions, per_token_grads))
    return chunks.merge(hidden_grads), weights_grad.astype(output_weights.dtype), None


_chunk_losses.defvjp(_chunk_losses_forward, _chunk_losses_backward)
