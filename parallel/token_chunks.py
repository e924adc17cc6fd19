"""Cutting a sequence that is sharded over devices into chunks that every device shares.

Per-token work whose intermediates are much wider than the activations (the loss's
logits, the MLP's [tokens, d_ff] products) can run one chunk of tokens at a time under a
`lax.scan` whose body is rematerialised: forward and backward then hold one chunk's
intermediates instead of the whole sequence's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

# (parameter, its logical axes, compute dtype) -> the parameter whole but for tensor
# parallelism (the strategy's sharding constraint), gathered in the compute dtype: what a
# chunk loop's body computes with, gathered once before the loop.
GatherWeight = Callable[[jax.Array, tuple[str, ...], jnp.dtype], jax.Array]


@dataclasses.dataclass(frozen=True)
class TokenChunks:
    """Cuts [b, seq_len, ...] into [n_chunks, b, shards * piece_len, ...] and back.

    Each of the `shards` contiguous parts of the sequence (one per device when it is
    sharded over the context axis) is cut into the same n_chunks strided pieces: piece k
    holds the part's tokens k, k + n_chunks, k + 2 n_chunks, ...; chunk k is piece k of
    every part. So every chunk takes its tokens from every device's own part, and each
    device works on its own tokens, as without chunks. (Contiguous chunks would each live
    on one device: the scan would keep the others idle or move tokens between devices.)

    A part of seq_len / shards tokens is cut into n_chunks pieces of at most
    chunk_tokens / shards tokens; when n_chunks does not divide the part, each part is
    padded at its end with fewer than n_chunks tokens: the padding stays on its device,
    where padding the whole sequence would shift tokens across devices.
    """
    seq_len: int
    chunk_tokens: int
    shards: int = 1

    def __post_init__(self):
        if self.seq_len % self.shards:
            raise ValueError(f"sequence length {self.seq_len} is not divisible by "
                             f"sequence_shards={self.shards}")

    @property
    def part_len(self) -> int:
        return self.seq_len // self.shards

    @property
    def n_chunks(self) -> int:
        piece_limit = max(self.chunk_tokens // self.shards, 1)  # >= 1 token of every part
        return -(-self.part_len // piece_limit)

    @property
    def piece_len(self) -> int:
        return -(-self.part_len // self.n_chunks)

    @property
    def padding(self) -> int:
        return self.n_chunks * self.piece_len - self.part_len

    def split(self, x: jax.Array) -> jax.Array:
        """[b, seq_len, ...] -> [n_chunks, b, shards * piece_len, ...] (padding zeros)."""
        b, rest = x.shape[0], x.shape[2:]
        x = x.reshape(b, self.shards, self.part_len, *rest)
        x = jnp.pad(x, [(0, 0), (0, 0), (0, self.padding)] + [(0, 0)] * len(rest))
        x = x.reshape(b, self.shards, self.piece_len, self.n_chunks, *rest)
        return jnp.moveaxis(x, 3, 0).reshape(self.n_chunks, b, self.shards * self.piece_len,
                                             *rest)

    def merge(self, chunks: jax.Array) -> jax.Array:
        """The inverse of `split`: [n_chunks, b, shards * piece_len, ...] -> [b, seq_len, ...]."""
        b, rest = chunks.shape[1], chunks.shape[3:]
        x = chunks.reshape(self.n_chunks, b, self.shards, self.piece_len, *rest)
        x = jnp.moveaxis(x, 0, 3).reshape(b, self.shards, self.piece_len * self.n_chunks, *rest)
        return x[:, :, :self.part_len].reshape(b, self.seq_len, *rest)

    def map(self, fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """fn applied to [b, seq_len, ...] one chunk at a time, rematerialised: backward
        keeps each chunk's input and recomputes the rest. fn must act on each token alone."""
        # prevent_cse is only needed outside a scan (the docs recommend False inside one).
        chunk_fn = jax.checkpoint(fn, prevent_cse=False)
        return self.merge(jax.lax.map(chunk_fn, self.split(x)))


def chunks_for(chunk_tokens: int, seq_len: int, shards: int) -> TokenChunks | None:
    """TokenChunks of at most chunk_tokens tokens (whole sequence, all devices together);
    None when 0 or when one chunk would hold the whole sequence."""
    if chunk_tokens <= 0 or chunk_tokens >= seq_len:
        return None
    return TokenChunks(seq_len, chunk_tokens, shards)


# loss.chunk_tokens = null: chunks of up to this many tokens per sequence. One chunk's f32
# logits then take batch x 4096 x vocab x 4 bytes before sharding (2 GB for one Llama 3
# row), while the matmuls stay large enough to keep the chip busy.
DEFAULT_CHUNK_TOKENS = 4096


def resolve_chunk_tokens(chunk_tokens: int | None, seq_len: int) -> int:
    """Tokens per chunk for loss.chunk_tokens; seq_len means one chunk (unchunked).

    None picks min(seq_len, DEFAULT_CHUNK_TOKENS); 0 and anything >= seq_len mean unchunked.
    """
    if chunk_tokens is None:
        chunk_tokens = DEFAULT_CHUNK_TOKENS
    if chunk_tokens < 0:
        raise ValueError(f"loss.chunk_tokens must be >= 0 (0 = unchunked), got {chunk_tokens}")
    return seq_len if chunk_tokens == 0 else min(chunk_tokens, seq_len)
