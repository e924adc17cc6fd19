"""Chunked cross-entropy (trainer/model/loss.py): equals the unchunked loss and gradients, on one
device and sharded, and never holds the whole logits (TPU AOT memory figures)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lctrain.parallel.mesh import build_mesh
from lctrain.parallel.sharding import batch_sharding, logical_spec
from lctrain.parallel.token_chunks import DEFAULT_CHUNK_TOKENS, resolve_chunk_tokens
from lctrain.recipes.schema import LossConfig
from lctrain.trainer.model.loss import next_token_loss
from tpu_aot import compiled_memory, tpu_mesh

# f32 throughout: chunking (and sharding) only change the order of the sums, so loss,
# count and gradients agree to f32 rounding: within RTOL of each entry or RTOL of the
# array's largest entry (a weight gradient sums hundreds of tokens, so an entry near 0 can
# be left with the rounding error of its larger terms).
RTOL = 1e-5
UNCHUNKED = LossConfig(chunk_tokens=0)


def make_inputs(batch: int, seq: int, d_model: int, vocab: int, seed: int = 0):
    """Random hidden states, unembedding and targets, with a packed-documents loss mask:
    random document boundaries (a document's last token predicts nothing) and padding."""
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(batch, seq, d_model)).astype(np.float32)
    # Logits with a spread of a few units, like a trained model's, not all ~0.
    weights = (rng.normal(size=(d_model, vocab)) * 3 / np.sqrt(d_model)).astype(np.float32)
    targets = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    boundary = rng.random((batch, seq)) < 0.1
    padding = np.arange(seq) >= seq - seq // 8
    loss_mask = ~boundary & ~padding
    return hidden, weights, targets, loss_mask


def loss_and_grads(config: LossConfig, hidden, weights, targets, loss_mask, z_loss,
                   sequence_shards: int = 1):
    """((loss sum, token count), (d sum / d hidden, d sum / d weights)), jitted: sharded
    inputs give a sharded (GSPMD) computation."""
    def loss_sum(hidden, weights, targets, loss_mask):
        return next_token_loss(hidden, weights, targets, loss_mask, z_loss, config,
                               sequence_shards)
    grad_fn = jax.value_and_grad(loss_sum, argnums=(0, 1), has_aux=True)
    return jax.jit(grad_fn)(hidden, weights, targets, loss_mask)


def assert_same(result, expected):
    def close(x, y):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL * np.max(np.abs(y)))
    jax.tree.map(close, result, expected)


@functools.cache
def unchunked_on_one_device(seq, z_loss):
    """The reference of the cases below that share a length and z-loss, computed once."""
    return loss_and_grads(UNCHUNKED, *make_inputs(batch=2, seq=seq, d_model=32, vocab=997),
                          z_loss)


@pytest.mark.parametrize("seq, chunk_tokens, shards, z_loss", [
    (48, 16, 1, 1e-2),   # 3 chunks (odd), no padding
    (50, 20, 1, 1e-2),   # 3 chunks of 17, 1 padded token
    (50, 16, 1, 1e-2),   # 4 chunks of 13, 2 padded tokens
    (50, 7, 1, 0.0),     # 8 chunks of 7, 6 padded tokens, no z-loss
    (50, 16, 2, 1e-2),   # 2 parts of 25, each 4 pieces of 7 with 3 padded tokens
    (48, 2, 4, 1e-2),    # chunk_tokens < shards: chunks of one token per part
])
def test_chunked_equals_unchunked(seq, chunk_tokens, shards, z_loss):
    inputs = make_inputs(batch=2, seq=seq, d_model=32, vocab=997)
    expected = unchunked_on_one_device(seq, z_loss)
    result = loss_and_grads(LossConfig(chunk_tokens=chunk_tokens), *inputs, z_loss, shards)
    assert_same(result, expected)
    # The count is the mask's, padding not included.
    assert expected[0][1].tokens == inputs[3].sum()


@pytest.mark.parametrize("axis_sizes, seq, chunk_tokens", [
    # Sequence over context=2, unembedding over fsdp x tensor; 3 chunks of 32, 16 per device.
    (dict(data=1, fsdp=2, context=2, tensor=2), 96, 32),
    # Sequence over context=4: 25 tokens per device, cut into 3 pieces of 9 (2 padded).
    (dict(data=2, fsdp=1, context=4, tensor=1), 100, 40),
])
def test_sharded_chunked_equals_unchunked(axis_sizes, seq, chunk_tokens):
    mesh = build_mesh(axis_sizes, devices=jax.devices()[:8])
    hidden, weights, targets, loss_mask = make_inputs(batch=4, seq=seq, d_model=32, vocab=1000)
    z_loss = 1e-2
    expected = loss_and_grads(UNCHUNKED, hidden, weights, targets, loss_mask, z_loss)

    tokens = batch_sharding(mesh)   # [batch, sequence, ...] as the train step shards it
    unembedding = NamedSharding(mesh, logical_spec(mesh, ("embed", "vocab"), weights.shape))
    sharded_inputs = jax.device_put((hidden, weights, targets, loss_mask),
                                    (tokens, unembedding, tokens, tokens))
    result = loss_and_grads(LossConfig(chunk_tokens=chunk_tokens), *sharded_inputs, z_loss,
                            axis_sizes["context"])
    assert_same(result, expected)
    # The hidden gradient comes back with the hidden states' sharding: the chunks were
    # laid out along the devices' own parts of the sequence.
    assert result[1][0].sharding.is_equivalent_to(tokens, hidden.ndim)


def test_bfloat16_weight_gradient_sums_chunks_in_float32():
    """bf16 inputs, 128 chunks: the output weights' gradient is as close to the f32 result
    as the unchunked one's (measured 0.0024 vs 0.0019 of the largest entry). Summed over
    the chunks in bf16, as differentiating the chunk scan did, it was 0.017."""
    hidden, weights, targets, loss_mask = make_inputs(2, 4096, 64, 256)
    hidden, weights = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weights, jnp.bfloat16)

    def weights_grad(config, dtype):
        grads = loss_and_grads(config, hidden.astype(dtype), weights.astype(dtype), targets,
                               loss_mask, 0.0)[1]
        return np.asarray(grads[1], np.float32)

    exact = weights_grad(UNCHUNKED, jnp.float32)

    def error(config):
        return np.max(np.abs(weights_grad(config, jnp.bfloat16) - exact)) / np.max(np.abs(exact))

    assert error(LossConfig(chunk_tokens=64)) < 1.5 * error(UNCHUNKED)


def test_chunk_tokens_resolution():
    assert resolve_chunk_tokens(None, 128 * 1024) == DEFAULT_CHUNK_TOKENS
    assert resolve_chunk_tokens(None, 256) == 256         # short sequences: one chunk
    assert resolve_chunk_tokens(0, 1000) == 1000          # 0: unchunked
    assert resolve_chunk_tokens(300, 1000) == 300
    with pytest.raises(ValueError, match="chunk_tokens"):
        resolve_chunk_tokens(-1, 1000)


@pytest.mark.slow
def test_chunked_loss_never_holds_the_whole_logits():
    """TPU v5p, 4 chips: batch over fsdp, sequence over context, 32K tokens x 32K vocab per
    chip, so the unchunked f32 logits alone take N = 4 GiB per chip. Compiled loss + its
    gradient: the unchunked temporaries exceed N, the chunked ones stay under N / 4."""
    mesh = tpu_mesh("v5p:2x2x1", dict(data=1, fsdp=2, context=2, tensor=1))
    batch, seq, d_model, vocab = 2, 64 * 1024, 256, 32 * 1024
    per_chip_logits = (batch // 2) * (seq // 2) * vocab * 4

    tokens = batch_sharding(mesh)
    unembedding = NamedSharding(mesh, logical_spec(mesh, ("embed", "vocab"), (d_model, vocab)))
    abstract_args = (jax.ShapeDtypeStruct((batch, seq, d_model), jnp.bfloat16),
                     jax.ShapeDtypeStruct((d_model, vocab), jnp.float32),
                     jax.ShapeDtypeStruct((batch, seq), jnp.int32),
                     jax.ShapeDtypeStruct((batch, seq), jnp.bool_))
    out_shardings = ((NamedSharding(mesh, P()),) * 2, (tokens, unembedding))

    def temp_bytes(config: LossConfig) -> int:
        def fn(hidden, weights, targets, loss_mask):
            return loss_and_grads(config, hidden, weights, targets, loss_mask, 1e-4,
                                  sequence_shards=2)
        memory = compiled_memory(fn, (tokens, unembedding, tokens, tokens), out_shardings,
                                 *abstract_args)
        return memory.temp_size_in_bytes

    unchunked, chunked = temp_bytes(UNCHUNKED), temp_bytes(LossConfig(chunk_tokens=None))
    print(f"\nper chip: N = {per_chip_logits:,} B; temp bytes unchunked {unchunked:,} B "
          f"({unchunked / 2**30:.3f} GiB), chunked {chunked:,} B ({chunked / 2**30:.3f} GiB)")
    assert unchunked > per_chip_logits
    assert chunked < per_chip_logits / 4
