"""A Llama-3.x decoder in Flax NNX: RMSNorm, RoPE (none, linear, llama3 or yarn scaling), GQA,
SwiGLU, and Qwen2's q/k/v biases.

Every parameter carries `axes`, its logical axis names; `lctrain.parallel.sharding` maps
them onto the mesh. Layers are stacked on a leading 'layers' axis and applied with
`lax.scan`, so compile time does not grow with depth; with model.layer_pattern (global and
sliding-window layers mixed) the scan steps over whole repeats of the pattern. Attention
itself is a callable the caller passes in per layer kind (the context-parallel strategy,
bound to the kind's window), so the model knows nothing of the mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lctrain.kernels.residuals import CONTEXT
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


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Per-pair rotation speeds and the scale of cos/sin, as transformers defines them for
    each model.rope_scaling type. Computed in float64 from the recipe alone (constants)."""
    half = np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** half
    scaling = cfg.rope_scaling
    if scaling.type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if scaling.type == "yarn":
        return _yarn_frequencies(inv_freq, cfg.head_dim, cfg.rope_theta, scaling)
    return inv_freq, 1.0


def _llama3_frequencies(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Llama 3.1: wavelengths beyond original/low_freq_factor are divided by the factor,
    those below original/high_freq_factor kept, and a smooth blend in between."""
    original = scaling.original_max_position_embeddings
    wavelength = 2 * np.pi / inv_freq
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelength > original / scaling.low_freq_factor,
                      inv_freq / scaling.factor, blended)
    return np.where(wavelength < original / scaling.high_freq_factor, inv_freq, scaled)


def _yarn_frequencies(inv_freq: np.ndarray, head_dim: int, theta: float,
                      scaling) -> tuple[np.ndarray, float]:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by the factor, those turning more than beta_fast times kept, a linear ramp
    between; cos and sin are scaled by the attention factor."""
    def dimension_of(rotations):
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 1e-3), 0, 1)
    kept = 1 - ramp
    inv_freq = inv_freq / scaling.factor * (1 - kept) + inv_freq * kept
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(scaling.factor) + 1 if scaling.factor > 1 else 1.0
    return inv_freq, attention_factor


def rotary_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin [b, s, 1, d/2] of each token's true position, shared by all layers (of
    a kind: see kind_config)."""
    inv_freq, scale = rope_frequencies(cfg)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    return (scale * jnp.cos(angles))[:, :, None, :], (scale * jnp.sin(angles))[:, :, None, :]


def kind_config(cfg: ModelConfig, kind: str) -> ModelConfig:
    """The model as one kind's layers see it: their model.layer_pattern rope_theta."""
    theta = cfg.layer_group(kind).rope_theta
    return cfg if theta is None else dataclasses.replace(cfg, rope_theta=theta)


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
        if cfg.qkv_bias:  # Qwen2
            self.bq = nnx.Param(jnp.zeros((h, d), jnp.float32), axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((kv, d), jnp.float32), axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((kv, d), jnp.float32), axes=("kv_heads", "head_dim"))
        else:
            self.bq = self.bk = self.bv = None

    @staticmethod
    def project(x, weight: nnx.Param, bias: nnx.Param | None):
        out = jnp.einsum("bse,ehd->bshd", x, _weight(weight, x.dtype))
        return out if bias is None else out + _weight(bias, x.dtype)

    def __call__(self, x, positions, segment_ids, rotary, attend: Attend):
        dtype = x.dtype
        q = checkpoint_name(self.project(x, self.wq, self.bq), "query_proj")
        k = checkpoint_name(self.project(x, self.wk, self.bk), "key_proj")
        v = checkpoint_name(self.project(x, self.wv, self.bv), "value_proj")
        q = apply_rope(q, rotary)
        k = apply_rope(k, rotary)
        context = checkpoint_name(attend(q, k, v, positions, segment_ids), CONTEXT)
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
        # Tied, the embedding is also the output matrix, used unscaled as transformers does:
        # initialised like one (std 1/sqrt(d_model)) so the first logits are of order one.
        embedding_std = 1 / math.sqrt(cfg.d_model) if cfg.tie_embeddings else 1.0
        self.embedding = nnx.Param(
            embedding_std * jax.random.normal(rngs.params(), (cfg.vocab, cfg.d_model),
                                              jnp.float32),
            axes=("vocab", "embed"))
        self.layers = _stacked_layers(cfg, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.unembedding = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"),
                                      cfg.d_model)

    def output_weights(self) -> jax.Array:
        """[d_model, vocab] matrix the loss multiplies the final hidden states with."""
        if self.cfg.tie_embeddings:
            return self.embedding[...].T
        return self.unembedding[...]

    def __call__(self, tokens, positions, segment_ids, *,
                 attend: Attend | Mapping[str, Attend],
                 remat_policy: Callable | None = None,
                 split_tokens: Callable[[jax.Array], jax.Array] = lambda x: x,
                 mlp_chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes: w) -> jax.Array:
        """Final (normalized) hidden states [b, s, d_model] in the compute dtype.

        `attend` maps each layer kind to its attention (bound to the kind's window); one
        callable serves a model whose layers are all global. `split_tokens` pins a
        [b, s, ...] activation to the devices holding its tokens (the strategy's sharding
        constraint); without it XLA may, e.g., build the rotary tables for the whole
        sequence on every device. `mlp_chunks` runs each MLP one chunk of tokens at a time
        (remat.mlp_chunk_tokens), with its weights from `gather_weight`."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = split_tokens(jnp.take(self.embedding[...], tokens, axis=0).astype(dtype))
        kinds = self.cfg.layer_kinds()
        attends = _attends_by_kind(attend, set(kinds))
        rotary = {kind: tuple(map(split_tokens, rotary_tables(positions,
                                                              kind_config(self.cfg, kind))))
                  for kind in attends}
        graphdef, stacked = nnx.split(self.layers)

        def one_layer(kind: str) -> Callable:
            def apply(x, layer_state):
                layer = nnx.merge(graphdef, layer_state)
                return split_tokens(layer(x, positions, segment_ids, rotary[kind],
                                          attends[kind], mlp_chunks, gather_weight))

            if remat_policy is None:
                return apply
            return jax.checkpoint(apply, policy=remat_policy, prevent_cse=False)

        layer_fns = {kind: one_layer(kind) for kind in attends}
        period = kinds[:len(self.cfg.pattern_kinds())]  # all of them when fewer layers
        x = scan_layers(x, stacked, [layer_fns[kind] for kind in period])
        return self.final_norm(x)


def _attends_by_kind(attend: Attend | Mapping[str, Attend], kinds: set[str]) -> dict[str, Attend]:
    if not isinstance(attend, Mapping):
        if kinds != {"global"}:  # a bare attend knows no window
            raise ValueError(f"the model has {', '.join(sorted(kinds))} layers: pass attend "
                             f"as a map layer kind -> attend")
        attend = {"global": attend}
    missing = kinds - set(attend)
    if missing:
        raise ValueError(f"no attend for the {', '.join(sorted(missing))} layers")
    return {kind: attend[kind] for kind in sorted(kinds)}


def scan_layers(x: jax.Array, stacked: nnx.State, pattern: list[Callable]) -> jax.Array:
    """Applies the stacked layers (leading 'layers' axis) in order, layer i with
    pattern[i % len(pattern)] (x, layer i's state) -> x. Whole repeats of the pattern are
    scanned, one per step (the body applies its layers in turn), so compile time grows with
    the pattern, not with depth; the layers after the last whole repeat (a prefix of the
    pattern) follow unscanned."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    period = len(pattern)
    repeats = layers // period

    def one_repeat(x, states):
        for i, apply in enumerate(pattern):
            x = apply(x, states if period == 1 else _layer(states, i))
        return x, None

    if repeats:
        scanned = stacked if repeats * period == layers else jax.tree.map(
            lambda p: p[:repeats * period], stacked)
        if period > 1:
            scanned = jax.tree.map(lambda p: p.reshape(repeats, period, *p.shape[1:]), scanned)
        x, _ = jax.lax.scan(one_repeat, x, scanned)
    for i in range(repeats * period, layers):
        x = pattern[i - repeats * period](x, _layer(stacked, i))
    return x


def _layer(states: nnx.State, i: int) -> nnx.State:
    return jax.tree.map(lambda p: p[i], states)


def count_parameters(cfg: ModelConfig) -> int:
    e, f, v, layers = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.layers
    attention = e * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    biases = cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads) if cfg.qkv_bias else 0
    per_layer = attention + biases + 3 * e * f + 2 * e
    embeddings = v * e * (1 if cfg.tie_embeddings else 2)
    return layers * per_layer + embeddings + e
