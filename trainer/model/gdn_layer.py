"""Qwen3-Next's Gated DeltaNet layer (transformers' Qwen3NextGatedDeltaNet), the sequence
mixer of model.layer_pattern's linear layers in place of attention.

From the normed input x: q, k [h_k heads of d_k], v and the output gate z [h_v of d_v]
(in_proj_qkvz), b and a [h_v] (in_proj_ba); a causal depthwise conv (model.
linear_conv_kernel taps, SiLU) over q, k, v; beta = sigmoid(b), the log decay g =
-exp(A_log) softplus(a + dt_bias); the gated delta rule (kernels/gdn.py: q and k
l2-normalised inside); an RMSNorm of each output head times SiLU(z); out_proj.

The conv and the delta rule read the sequence beyond the token, so they are the `mix`
the caller passes in (parallel/linear_mix.linear_mix bound to the layer kind's strategy),
as attention layers get their `attend`: the layer knows nothing of the mesh. Projections
are kept per head ([d_model, heads, head_dim]) as the attention layers' are, q, k, v, z
apart (transformers interleaves them per key head in one in_proj_qkvz).
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lctrain.kernels.residuals import CONTEXT
from lctrain.recipes.schema import ModelConfig
from lctrain.trainer.model.params import param, weight

# transformers draws A (the decay rate, A_log = log A) uniformly from this range.
DECAY_RATE_RANGE = (0.01, 16.0)


class Mix(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array,
                 conv_weights: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array,
                 beta: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array: ...


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, kernel = cfg.d_model, cfg.linear_conv_kernel
        hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.wq = param(rngs, (e, hk, dk), ("embed", "kv_heads", "head_dim"), e)
        self.wk = param(rngs, (e, hk, dk), ("embed", "kv_heads", "head_dim"), e)
        self.wv = param(rngs, (e, hv, dv), ("embed", "heads", "head_dim"), e)
        self.wz = param(rngs, (e, hv, dv), ("embed", "heads", "head_dim"), e)
        self.wb = param(rngs, (e, hv), ("embed", "heads"), e)
        self.wa = param(rngs, (e, hv), ("embed", "heads"), e)
        self.conv_q = param(rngs, (kernel, hk, dk), (None, "kv_heads", "head_dim"), kernel)
        self.conv_k = param(rngs, (kernel, hk, dk), (None, "kv_heads", "head_dim"), kernel)
        self.conv_v = param(rngs, (kernel, hv, dv), (None, "heads", "head_dim"), kernel)
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32), axes=("heads",))
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (hv,), jnp.float32, *DECAY_RATE_RANGE)), axes=("heads",))
        self.norm_scale = nnx.Param(jnp.ones((dv,), jnp.float32), axes=("head_dim",))
        self.wo = param(rngs, (hv, dv, e), ("heads", "head_dim", "embed"), hv * dv)
        self.eps = cfg.norm_eps

    def __call__(self, x, positions, segment_ids, rotary, mix: Mix):
        """x [b, s, d_model] (normed) -> [b, s, d_model]; `rotary` is unused (no RoPE)."""
        dtype = x.dtype

        def heads(w):
            return jnp.einsum("bse,ehd->bshd", x, weight(w, dtype))

        q = checkpoint_name(heads(self.wq), "query_proj")
        k = checkpoint_name(heads(self.wk), "key_proj")
        v = checkpoint_name(heads(self.wv), "value_proj")
        z = heads(self.wz)
        b, a = (jnp.einsum("bse,eh->bsh", x, weight(w, dtype)).astype(jnp.float32)
                for w in (self.wb, self.wa))
        beta = jax.nn.sigmoid(b)
        g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        conv_weights = tuple(weight(w, dtype) for w in (self.conv_q, self.conv_k, self.conv_v))
        core = checkpoint_name(mix(q, k, v, conv_weights, g, beta, positions, segment_ids),
                               CONTEXT)
        gated = gated_rms_norm(core, z, self.norm_scale[...], self.eps)
        return checkpoint_name(jnp.einsum("bshd,hde->bse", gated, weight(self.wo, dtype)),
                               "out_proj")


def gated_rms_norm(x, gate, scale, eps):
    """transformers' Qwen3NextRMSNormGated: x normed over its last axis in f32, times
    `scale` in x's dtype, times SiLU(gate) in f32."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
    scaled = scale.astype(x.dtype) * normed.astype(x.dtype)
    return (scaled * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
