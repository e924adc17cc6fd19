"""A Llama-3.x decoder in Flax NNX: RMSNorm, RoPE (with Llama 3.1 scaling), GQA, SwiGLU.

Every parameter carries `axes`, its logical axis names; `lctrain.parallel.sharding` maps
them onto the mesh. Layers are stacked on a leading 'layers' axis and applied with
`lax.scan`, so compile time does not grow with depth. Attention itself is a callable the
caller passes in (the context-parallel strategy), so the model knows nothing of the mesh.
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lctrain.recipes.schema import ModelConfig
from lctrain.trainer.token_chunks import GatherWeight, TokenChunks


class Attend(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array: ...


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
           fan_in: int) -> nnx.Param:
    init = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(init, axes=axes)


def _weight(param: nnx.Param, dtype) -> jax.Array:
    return param[...].astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def rope_inverse_frequencies(cfg: ModelConfig) -> jax.Array:
    """Per-pair rotation speeds; Llama 3.1 slows the low frequencies for long context."""
    exponents = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    if not cfg.rope_scaling_factor:
        return inv_freq
    # Llama 3.1's constants: wavelengths beyond original_context/low_freq_factor are divided
    # by the factor, those below original_context/high_freq_factor kept, smooth in between.
    factor, low_freq_factor, high_freq_factor, original_context = (
        cfg.rope_scaling_factor, 1.0, 4.0, 8192.0)
    wavelength = 2 * jnp.pi / inv_freq
    smooth = (original_context / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = jnp.where(wavelength > original_context / low_freq_factor, inv_freq / factor,
                       blended)
    return jnp.where(wavelength < original_context / high_freq_factor, inv_freq, scaled)


def rotary_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [b, s, 1, d/2] of each token's true position, shared by all layers."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, rotary: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates [b, s, heads, d] by the rotary tables (rotate-half convention)."""
    cos, sin = rotary
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, h, kv, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e)
        self.wk = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), e)
        self.wv = _param(rngs, (e, kv, d), ("embed", "kv_heads", "head_dim"), e)
        self.wo = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), h * d)

    def __call__(self, x, positions, segment_ids, rotary, attend: Attend):
        dtype = x.dtype
        q = checkpoint_name(jnp.einsum("bse,ehd->bshd", x, _weight(self.wq, dtype)), "query_proj")
        k = checkpoint_name(jnp.einsum("bse,ehd->bshd", x, _weight(self.wk, dtype)), "key_proj")
        v = checkpoint_name(jnp.einsum("bse,ehd->bshd", x, _weight(self.wv, dtype)), "value_proj")
        q = apply_rope(q, rotary)
        k = apply_rope(k, rotary)
        context = checkpoint_name(attend(q, k, v, positions, segment_ids), "context")
        out = jnp.einsum("bshd,hde->bse", context, _weight(self.wo, dtype))
        return checkpoint_name(out, "out_proj")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f = cfg.d_model, cfg.d_ff
        self.gate = _param(rngs, (e, f), ("embed", "mlp"), e)
        self.up = _param(rngs, (e, f), ("embed", "mlp"), e)
        self.down = _param(rngs, (f, e), ("mlp", "embed"), f)

    def __call__(self, x, chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes: w):
        """SwiGLU over [b, s, e]; with `chunks`, one chunk of tokens at a time."""
        if chunks is None:
            return swiglu(x, self.gate[...], self.up[...], self.down[...])
        # The weights are gathered whole before the chunk loop (inside it XLA would gather
        # them, and reduce their gradients, once per chunk) and stay float32 there, so their
        # gradients add up over the chunks in float32 rather than in the compute dtype.
        gate = gather_weight(self.gate[...], ("embed", "mlp"))
        up = gather_weight(self.up[...], ("embed", "mlp"))
        down = gather_weight(self.down[...], ("mlp", "embed"))
        return chunks.map(lambda chunk: swiglu(chunk, gate, up, down), x)


def swiglu(x, gate, up, down):
    dtype = x.dtype
    gate = checkpoint_name(x @ gate.astype(dtype), "mlpwi")
    up = checkpoint_name(x @ up.astype(dtype), "mlpwi")
    return checkpoint_name((jax.nn.silu(gate) * up) @ down.astype(dtype), "mlpwo")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, segment_ids, rotary, attend: Attend,
                 mlp_chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes: w):
        x = checkpoint_name(x, "decoder_layer_input")
        x = x + self.attention(self.attention_norm(x), positions, segment_ids, rotary, attend)
        return x + self.mlp(self.mlp_norm(x), mlp_chunks, gather_weight)


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """cfg.layers decoder layers as one module whose parameters have a leading 'layers' axis."""
    keys = jax.random.split(rngs.params(), cfg.layers)
    states = jax.vmap(lambda key: nnx.state(DecoderLayer(cfg, nnx.Rngs(key))))(keys)
    states = jax.tree.map(lambda p: p.replace(axes=("layers", *p.axes)), states,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, states)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab, cfg.d_model), jnp.float32),
            axes=("vocab", "embed"))
        self.layers = _stacked_layers(cfg, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.unembedding = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"),
                                      cfg.d_model)

    def output_weights(self) -> jax.Array:
        """[d_model, vocab] matrix the loss multiplies the final hidden states with."""
        if self.cfg.tie_embeddings:
            return self.embedding[...].T / math.sqrt(self.cfg.d_model)
        return self.unembedding[...]

    def __call__(self, tokens, positions, segment_ids, *, attend: Attend,
                 remat_policy: Callable | None = None,
                 split_tokens: Callable[[jax.Array], jax.Array] = lambda x: x,
                 mlp_chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes: w) -> jax.Array:
        """Final (normalized) hidden states [b, s, d_model] in the compute dtype.

        `split_tokens` pins a [b, s, ...] activation to the devices holding its tokens (the
        strategy's sharding constraint); without it XLA may, e.g., build the rotary tables
        for the whole sequence on every device. `mlp_chunks` runs each MLP one chunk of
        tokens at a time (remat.mlp_chunk_tokens), with its weights from `gather_weight`."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = split_tokens(jnp.take(self.embedding[...], tokens, axis=0).astype(dtype))
        rotary = tuple(map(split_tokens, rotary_tables(positions,
                                                       rope_inverse_frequencies(self.cfg))))
        graphdef, stacked = nnx.split(self.layers)

        def one_layer(x, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return split_tokens(layer(x, positions, segment_ids, rotary, attend, mlp_chunks,
                                      gather_weight)), None

        if remat_policy is not None:
            one_layer = jax.checkpoint(one_layer, policy=remat_policy, prevent_cse=False)
        x, _ = jax.lax.scan(one_layer, x, stacked)
        return self.final_norm(x)


def count_parameters(cfg: ModelConfig) -> int:
    e, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.layers
    attention = e * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    per_layer = attention + 3 * e * f + 2 * e
    embeddings = v * e * (1 if cfg.tie_embeddings else 2)
    return layers * per_layer + embeddings + e
