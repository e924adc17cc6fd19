"""TokenChunks: the strided chunk layout shared by the chunked loss and the chunked MLP."""

import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.parallel.token_chunks import TokenChunks, chunks_for


@pytest.mark.parametrize("seq_len, chunk_tokens, shards", [
    (64, 16, 4), (64, 24, 4), (60, 7, 2), (32, 1, 8), (48, 100, 1)])
def test_merge_undoes_split(seq_len, chunk_tokens, shards):
    chunks = TokenChunks(seq_len, chunk_tokens, shards)
    x = jnp.arange(2 * seq_len * 3).reshape(2, seq_len, 3)
    split = chunks.split(x)
    assert split.shape == (chunks.n_chunks, 2, shards * chunks.piece_len, 3)
    assert chunks.piece_len <= max(chunk_tokens // shards, 1)
    np.testing.assert_array_equal(chunks.merge(split), x)


def test_every_chunk_takes_tokens_from_every_shard():
    chunks = TokenChunks(seq_len=32, chunk_tokens=8, shards=4)     # 8 tokens per shard
    split = np.asarray(chunks.split(jnp.arange(32)[None]))[:, 0]   # [n_chunks, 4 * 2]
    shard_of_token = split // 8
    for chunk in shard_of_token:
        np.testing.assert_array_equal(chunk, [0, 0, 1, 1, 2, 2, 3, 3])
    assert sorted(split.ravel()) == list(range(32))


def test_map_applies_a_per_token_function_with_padding():
    chunks = TokenChunks(seq_len=14, chunk_tokens=6, shards=2)  # 7 tokens = 3 pieces of 3 - 2
    assert chunks.padding == 2
    x = jnp.linspace(-1, 1, 28).reshape(1, 14, 2)
    np.testing.assert_allclose(chunks.map(lambda t: jnp.tanh(t) * 3, x), jnp.tanh(x) * 3)


def test_chunks_for_off_and_whole():
    assert chunks_for(0, 64, 4) is None
    assert chunks_for(64, 64, 4) is None
    assert chunks_for(16, 64, 4) == TokenChunks(64, 16, 4)
