"""Gated DeltaNet (Qwen3-Next's linear attention): the gated delta rule in chunks.

Per value head a state S [d_k, d_v] runs over the tokens:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with q and k l2-normalised (eps 1e-6) and q scaled by d_k**-0.5 inside, as transformers'
torch_chunk_gated_delta_rule(use_qk_l2norm_in_kernel=True) does. Heads as in Qwen3-Next:
q, k have h_k heads, v, g, beta h_v (a multiple of h_k); value head j reads key head
j // (h_v / h_k). Everything inside runs in f32 (matmuls at HIGHEST precision: the TPU's
default rounds f32 operands to bf16, and the state carries that error from chunk to
chunk).

Chunked form (WY / UT transform, as in the DeltaNet papers): within a chunk of C tokens,
with cum_i the chunk-local cumulative sum of g and L[i, j] = exp(cum_i - cum_j) (j <= i),
the updates u = beta (v - k^T S_before) solve T u = beta v - diag(beta exp(cum)) K S_0,
T = I + strictly_lower(diag(beta) K K^T * L). So u = U - W S_0 with U, W from one
triangular solve that does not involve the state. A lax.scan over chunks computes them
and carries the state: out = (Q exp(cum)) S_0 + (Q K^T * L) u and S_end = exp(cum_C) S_0
+ (K exp(cum_C - cum))^T u. One chunk at a time, so only one chunk's [C, C] terms exist
at once (computing every chunk's up front would batch the matmuls wider but hold several
[b, h, s, C] and [b, h, s, d] f32 arrays).

Packed documents: g = -inf at a token zeroes the state before its update (a document's
first token; `reset_at_document_starts`). The chunked form turns each -inf into masks (no
NaN anywhere; the gradient of g there is 0, as the recurrence's).

Memory (custom VJP): the forward keeps its inputs (as given: bf16 stays bf16, key heads
unrepeated) and the state at the start of each segment of chunks, nothing else: about
sqrt(n) segments of sqrt(n) chunks (n = s / C), so about sqrt(n) states [b, h_v, d_k,
d_v] f32 rather than n (256 floats per token and head at 128 x 128, C 64: 4x bf16 q, k,
v). The backward redoes a segment's forward to get its chunk start states (one more
forward pass of the kernel, in all), then walks its chunks backwards, redoing one chunk's
terms and step at a time. The scans take one chunk of the inputs at a time, so their
f32, head-repeated copies and a chunk's [C, C] terms exist for one chunk only. Plain
autodiff of the same forward keeps every chunk's terms (pairwise decays, the solve's
results, the intra-chunk scores) and every scan step's intermediates. Measured on CPU
(b 1, s 4096, h 4, d_k = d_v = 128, C 64, f32 inputs): kept for the backward 26.1 MiB
(inputs 24.1, 8 segment start states 2) against 133.9 MiB by plain autodiff; the
compiled value-and-gradient's temporaries 47.4 against 169.9 MiB.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

PRECISION = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6


def gated_delta_rule(q, k, v, g, beta, *, chunk=64, initial_state=None):
    """q, k [b, s, h_k, d_k]; v [b, s, h_v, d_v]; g (log decay, <= 0; -inf: reset) and
    beta [b, s, h_v]; initial_state [b, h_v, d_k, d_v] (None: zeros) -> (out [b, s, h_v,
    d_v] in v's dtype, final state [b, h_v, d_k, d_v] f32). Any length: the last chunk is
    padded with tokens that leave the state alone (g = 0, beta = 0)."""
    _check_heads(k, v)
    if initial_state is None:
        initial_state = jnp.zeros((k.shape[0], v.shape[2], k.shape[3], v.shape[3]),
                                  jnp.float32)
    out, final = _chunked(q, k, v, g, beta, initial_state.astype(jnp.float32), chunk)
    return out.astype(v.dtype), final


def final_state(k, v, g, beta, *, chunk=64, initial_state):
    """The final state alone, [b, h_v, d_k, d_s] f32, of the rule above from
    initial_state [b, h_v, d_k, d_s]: no output, so no query is read and no scores are
    formed. A state wider than the values (d_s > d_v) reads them as zeros in its first
    d_s - d_v columns, which then only carry the initial state's (state passing's affine
    maps, parallel/state_passing.py); they are widened one chunk at a time."""
    _check_heads(k, v)
    if initial_state.shape[-1] < v.shape[-1]:
        raise ValueError(f"gated delta rule: a state of {initial_state.shape[-1]} columns "
                         f"is narrower than the {v.shape[-1]} value features")
    return _chunked(None, k, v, g, beta, initial_state.astype(jnp.float32), chunk)[1]


def _check_heads(k, v):
    h_k, h_v = k.shape[2], v.shape[2]
    if h_v % h_k:
        raise ValueError(f"gated delta rule: {h_v} value heads are not a multiple of "
                         f"{h_k} key heads")


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None):
    """The same, token by token (the definition; tests' reference)."""
    q, k, v, g, beta = _heads_f32(q, k, v, g, beta)
    b, _, h, d_k = k.shape
    state = (jnp.zeros((b, h, d_k, v.shape[-1]), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))

    def step(state, token):
        q_t, k_t, v_t, g_t, beta_t = token
        state = jnp.exp(g_t)[..., None, None] * state
        delta = beta_t[..., None] * (v_t - _einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, _einsum("bhkv,bhk->bhv", state, q_t)

    final, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0)
                                                  for x in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), final


def reset_at_document_starts(g, positions):
    """g [b, s, h] with -inf at every document's first token (position 0 in its document,
    as the data pipeline numbers them), so no state crosses into the next document."""
    return jnp.where(positions[..., None] == 0, -jnp.inf, g)


def l2normalized(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


class ChunkTerms(NamedTuple):
    """What a chunk's step needs, [b, h, C, ...] (state-independent)."""
    q: jax.Array          # q * exp(cum): reads the state carried in
    k: jax.Array          # k * exp(cum_C - cum): writes the state carried out
    u: jax.Array          # [.., C, d_v] the updates were the carried state zero
    w: jax.Array          # [.., C, d_k] what the carried state takes off them
    scores: jax.Array     # [.., C, C] (q k^T) * L, causal
    decay: jax.Array      # [b, h] exp(cum_C): the chunk's decay of the carried state


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=PRECISION)


def _heads_f32(q, k, v, g, beta, width=None):
    """f32 inputs, q (None: none) and k normalised (q also scaled) and repeated up to v's
    heads, v zero-widened in front to `width` features (None: as it is)."""
    k, v, g, beta = (x.astype(jnp.float32) for x in (k, v, g, beta))
    repeat = v.shape[2] // k.shape[2]
    if q is not None:
        q = q.astype(jnp.float32)
        q = jnp.repeat(l2normalized(q) * q.shape[-1] ** -0.5, repeat, axis=2)
    if width is not None:
        v = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(width - v.shape[-1], 0)])
    return q, jnp.repeat(l2normalized(k), repeat, axis=2), v, g, beta


def _segments(length, chunk):
    """(segments, chunks per segment) for `length` tokens: about sqrt(chunks) each, so the
    backward holds about 2 sqrt(chunks) states, not one per chunk. A divisor of the chunks
    up to twice sqrt(chunks) is taken where there is one (512 chunks: 16 of 32), so that no
    padding to whole segments copies the inputs; otherwise the padding is under one
    segment's chunks."""
    chunks = -(-length // chunk)
    root = math.isqrt(chunks - 1) + 1
    per_segment = next((n for n in range(root, 2 * root + 1) if chunks % n == 0), root)
    return -(-chunks // per_segment), per_segment


def _moved(x, source, destination):
    return None if x is None else jnp.moveaxis(x, source, destination)


def _to_segments(x, chunk):
    """[b, s, ...] -> [segments, chunks per segment, b, C, ...], zero-padded (None stays
    None)."""
    if x is None:
        return None
    b, length = x.shape[:2]
    segments, per_segment = _segments(length, chunk)
    x = jnp.pad(x, [(0, 0), (0, segments * per_segment * chunk - length)]
                + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, segments, per_segment, chunk, *x.shape[2:]), 0, 2)


def _from_segments(x, length):
    """[segments, chunks per segment, b, C, ...] -> [b, length, ...] (None stays None)."""
    if x is None:
        return None
    segments, per_segment, b, chunk = x.shape[:4]
    return jnp.moveaxis(x, 2, 0).reshape(b, segments * per_segment * chunk,
                                         *x.shape[4:])[:, :length]


def _chunk_terms(q, k, v, g, beta, width) -> ChunkTerms:
    """ChunkTerms of one chunk of the kernel's inputs ([b, C, heads, ...], as given) for
    a state of `width` columns: only a chunk at a time is ever in f32 with its key heads
    repeated and its values widened. Without q (None) the terms that read the state out,
    q and scores, are None."""
    q, k, v, g, beta = (None if x is None else jnp.moveaxis(x, 1, 2)
                        for x in _heads_f32(q, k, v, g, beta, width))
    chunk = g.shape[-1]
    starts = jnp.isneginf(g)
    cum = jnp.cumsum(jnp.where(starts, 0.0, g), axis=-1)
    # Documents begun in the chunk up to each token: equal counts share a document, and
    # only tokens before the chunk's first start see the carried state.
    doc = jnp.cumsum(starts, axis=-1)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    linked = causal & (doc[..., :, None] == doc[..., None, :])
    pair_decay = jnp.exp(jnp.where(linked, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    from_start = jnp.where(doc == 0, jnp.exp(cum), 0.0)
    to_end = jnp.where(doc == doc[..., -1:], jnp.exp(cum[..., -1:] - cum), 0.0)
    k_beta = k * beta[..., None]
    strictly_lower = _einsum("...id,...jd->...ij", k_beta, k) * pair_decay * ~jnp.eye(
        chunk, dtype=bool)
    solved = jax.lax.linalg.triangular_solve(
        strictly_lower, jnp.concatenate([v * beta[..., None], k_beta * from_start[..., None]],
                                        axis=-1),
        left_side=True, lower=True, unit_diagonal=True)
    d_v = v.shape[-1]
    reads = q is not None
    return ChunkTerms(
        q=q * from_start[..., None] if reads else None, k=k * to_end[..., None],
        u=solved[..., :d_v], w=solved[..., d_v:],
        scores=_einsum("...id,...jd->...ij", q, k) * pair_decay if reads else None,
        decay=jnp.where(doc[..., -1] == 0, jnp.exp(cum[..., -1]), 0.0))


def _chunk_step(state, terms: ChunkTerms):
    """(state at the chunk's end, the chunk's out [b, h, C, d_v] or None without a
    query) from its start state."""
    updates = terms.u - _einsum("bhcd,bhde->bhce", terms.w, state)
    out = None if terms.q is None else (_einsum("bhcd,bhde->bhce", terms.q, state)
                                        + _einsum("bhij,bhje->bhie", terms.scores, updates))
    state = terms.decay[..., None, None] * state + _einsum("bhcd,bhce->bhde", terms.k, updates)
    return state, out


def _scan_step(state, chunk_inputs):
    """(end state, (out [b, C, h, d_v], start state)) of one chunk."""
    end, out = _chunk_step(state, _chunk_terms(*chunk_inputs, width=state.shape[-1]))
    return end, (_moved(out, 1, 2), state)


def _segment_step(state, segment_inputs):
    """(end state, (out, start state)) of a segment's chunks."""
    end, (out, _) = jax.lax.scan(_scan_step, state, segment_inputs)
    return end, (out, state)


def _forward(q, k, v, g, beta, initial_state, chunk):
    """(out f32 (None without q), final state, the state at each segment's start
    [segments, b, h, d_k, d_v])."""
    final, (out, starts) = jax.lax.scan(
        _segment_step, initial_state,
        tuple(_to_segments(x, chunk) for x in (q, k, v, g, beta)))
    return _from_segments(out, k.shape[1]), final, starts


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked(q, k, v, g, beta, initial_state, chunk):
    out, final, _ = _forward(q, k, v, g, beta, initial_state, chunk)
    return out, final


def _chunked_fwd(q, k, v, g, beta, initial_state, chunk):
    out, final, starts = _forward(q, k, v, g, beta, initial_state, chunk)
    return (out, final), (q, k, v, g, beta, starts)


def _chunked_bwd(chunk, residuals, cotangents):
    *inputs, starts = residuals
    d_out, d_final = cotangents

    def backward_step(d_state, per_chunk):
        state, chunk_inputs, d_chunk_out = per_chunk
        terms, terms_vjp = jax.vjp(functools.partial(_chunk_terms, width=state.shape[-1]),
                                   *chunk_inputs)
        _, step_vjp = jax.vjp(_chunk_step, state, terms)
        d_state, d_terms = step_vjp((d_state, _moved(d_chunk_out, 1, 2)))
        return d_state, terms_vjp(d_terms)

    def backward_segment(d_state, per_segment):
        start, segment_inputs, d_segment_out = per_segment
        _, (_, chunk_starts) = jax.lax.scan(_scan_step, start, segment_inputs)
        return jax.lax.scan(backward_step, d_state,
                            (chunk_starts, segment_inputs, d_segment_out), reverse=True)

    d_initial, d_inputs = jax.lax.scan(
        backward_segment, d_final,
        (starts, tuple(_to_segments(x, chunk) for x in inputs), _to_segments(d_out, chunk)),
        reverse=True)
    length = inputs[1].shape[1]  # k's (q may be None)
    return (*(_from_segments(d, length) for d in d_inputs), d_initial)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
