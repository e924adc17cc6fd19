"""The causal depthwise convolution of Gated DeltaNet layers (Qwen3-Next's conv1d over q,
k, v: kernel K, no bias, SiLU after), within documents.

Output t = sum over taps j = 0 .. K-1 of weight[K-1-j] * x[t-j] (transformers' Conv1d with
K-1 zeros of left padding, so weight[K-1] multiplies the token itself). A tap counts only
where its token is the one j before in the same document: the same segment id and the
sequence index j lower. The indices make the caller's choice of the K-1 tokens before its
own (a neighbour's, or padding) safe: a wrong one (e.g. a cyclic send's) fails the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp



def causal_conv(x, weight, index, segment_ids):
    """x [rows, K-1 + n, F]: the K-1 tokens before a run of n, then the run; weight [K, F];
    index and segment_ids [rows, K-1 + n] of the same tokens (index: in the sequence) ->
    f32 [rows, n, F], SiLU of the convolution of the run's tokens."""
    width = weight.shape[0] - 1
    n = x.shape[1] - width
    weight = weight.astype(jnp.float32)
    own_index, own_segment = index[:, width:], segment_ids[:, width:]

    def tap(start):
        # Each tap's tokens are widened to f32 on their own, so that no f32 copy of the
        # whole of x is made (at 32K tokens of Qwen3-Next's q, k, v: 2 GiB per run).
        return x[:, start:start + n].astype(jnp.float32) * weight[start]

    out = tap(width)
    for j in range(1, width + 1):
        start = width - j
        same_document = ((index[:, start:start + n] == own_index - j)
                         & (segment_ids[:, start:start + n] == own_segment))
        out = out + jnp.where(same_document[..., None], tap(start), 0.0)
    return jax.nn.silu(out)
