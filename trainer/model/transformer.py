"""A Llama-3.x decoder in Flax NNX: RMSNorm, RoPE (none, linear, llama3 or yarn scaling:
trainer/model/rope.py), GQA, SwiGLU, Qwen2's q/k/v biases, and what Gemma 3 adds (norms
centred on 0, q/k norms, sublayer output norms, GeGLU, scaled embeddings, its own
attention scale; each a model key whose default is Llama's).

Every parameter carries `axes`, its logical axis names; `lctrain.parallel.sharding` maps
them onto the mesh. Layers are stacked on a leading 'layers' axis and applied with
`lax.scan`, so compile time does not grow with depth; with model.layer_pattern each scan
step picks its layer's kind with a switch (global and sliding-window layers share the
stack; linear layers, Gated DeltaNet in trainer/model/gdn_layer.py, have parameters of
their own and a second stack).
Attention itself is a callable the caller passes in per layer kind (the context-parallel
strategy, bound to the kind's window; for linear layers their conv and delta rule), so
the model knows nothing of the mesh.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lctrain.kernels.residuals import CONTEXT
from lctrain.parallel.token_chunks import GatherWeight, TokenChunks
from lctrain.recipes.schema import ModelConfig
from lctrain.trainer.model.gdn_layer import GatedDeltaNet
from lctrain.trainer.model.layer_scan import (layer_input, scan_layer_groups,
                                              scan_layers_by_kind)
from lctrain.trainer.model.params import param as _param, weight as _weight
from lctrain.trainer.model.rope import apply_rope, kind_config, rotary_tables


class Attend(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array: ...


class RMSNorm(nnx.Module):
    """Normalizes the last axis in float32 and multiplies by (offset + scale): model.norm_offset
    1 stores Gemma's weights centred on 0, so they start at 0 (a gain of one)."""

    def __init__(self, dim: int, cfg: ModelConfig, axes: tuple[str, ...] = ("embed",)):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - cfg.norm_offset, jnp.float32), axes=axes)
        self.eps = cfg.norm_eps
        self.offset = cfg.norm_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.offset + self.scale[...])).astype(x.dtype)


def _optional_norm(present: bool, dim: int, cfg: ModelConfig,
                   axes: tuple[str, ...] = ("embed",)) -> RMSNorm | None:
    return RMSNorm(dim, cfg, axes) if present else None


def _normed(norm: RMSNorm | None, x: jax.Array) -> jax.Array:
    return x if norm is None else norm(x)


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
        # Qwen3-Next: sigmoid(x wg) scales each head's output feature by feature.
        self.wg = (_param(rngs, (e, h, d), ("embed", "heads", "head_dim"), e)
                   if cfg.attention_output_gate else None)
        self.q_norm = _optional_norm(cfg.qk_norm, d, cfg, ("head_dim",))
        self.k_norm = _optional_norm(cfg.qk_norm, d, cfg, ("head_dim",))
        # The kernels scale scores by 1/sqrt(head_dim); another scale goes into q instead
        # (a factor of 1, and no multiply, where query_pre_attn_scalar is head_dim).
        scalar = cfg.query_pre_attn_scalar or d
        self.query_factor = math.sqrt(d / scalar) if scalar != d else None

    @staticmethod
    def project(x, weight: nnx.Param, bias: nnx.Param | None):
        out = jnp.einsum("bse,ehd->bshd", x, _weight(weight, x.dtype))
        return out if bias is None else out + _weight(bias, x.dtype)

    def __call__(self, x, positions, segment_ids, rotary, attend: Attend):
        dtype = x.dtype
        q = checkpoint_name(self.project(x, self.wq, self.bq), "query_proj")
        k = checkpoint_name(self.project(x, self.wk, self.bk), "key_proj")
        v = checkpoint_name(self.project(x, self.wv, self.bv), "value_proj")
        q = apply_rope(_normed(self.q_norm, q), rotary)
        k = apply_rope(_normed(self.k_norm, k), rotary)
        if self.query_factor is not None:
            q = q * jnp.asarray(self.query_factor, dtype)
        context = checkpoint_name(attend(q, k, v, positions, segment_ids), CONTEXT)
        if self.wg is not None:
            context = context * jax.nn.sigmoid(self.project(x, self.wg, None))
        out = jnp.einsum("bshd,hde->bse", context, _weight(self.wo, dtype))
        return checkpoint_name(out, "out_proj")


# model.mlp_activation: the gate's nonlinearity (SwiGLU, GeGLU with tanh-approximated GELU).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f = cfg.d_model, cfg.d_ff
        self.activation = cfg.mlp_activation
        self.gate = _param(rngs, (e, f), ("embed", "mlp"), e)
        self.up = _param(rngs, (e, f), ("embed", "mlp"), e)
        self.down = _param(rngs, (f, e), ("mlp", "embed"), f)

    def __call__(self, x, chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes, dtype: w):
        """The gated MLP over [b, s, e]; with `chunks`, one chunk of tokens at a time."""
        if chunks is None:
            return gated_mlp(*gradients_together(x, self.gate[...], self.up[...],
                                                 self.down[...]),
                             ACTIVATIONS[self.activation])
        # The weights are gathered whole, in the compute dtype, before the chunk loop
        # (inside it XLA would gather them, and reduce their gradients, once per chunk) and
        # are float32 there, so their gradients add up over the chunks in float32.
        gate = gather_weight(self.gate[...], ("embed", "mlp"), x.dtype)
        up = gather_weight(self.up[...], ("embed", "mlp"), x.dtype)
        down = gather_weight(self.down[...], ("mlp", "embed"), x.dtype)
        x, gate, up, down = gradients_together(x, gate, up, down)
        activation = ACTIVATIONS[self.activation]
        return chunks.map(lambda chunk: gated_mlp(chunk, gate, up, down, activation), x)


@jax.custom_vjp
def gradients_together(*arrays):
    """The arrays unchanged; in the backward, their gradients come out together.

    Used on the MLP's input and weights: the layer's attention backward (which needs the
    input's gradient) then waits for the MLP's weight gradients. Those feed nothing else in
    the layer, so XLA otherwise schedules their matmuls after the attention backward,
    holding the MLP's [tokens, d_ff] intermediates through it (benchmarks/RESULTS.md,
    "llama3.1-8b on 4 v5p chips, against MaxText")."""
    return arrays


def _gradients_together_forward(*arrays):
    return arrays, None


def _gradients_together_backward(_, gradients):
    return tuple(jax.lax.optimization_barrier(tuple(gradients)))


gradients_together.defvjp(_gradients_together_forward, _gradients_together_backward)


def gated_mlp(x, gate, up, down, activation=jax.nn.silu):
    dtype = x.dtype
    gate = checkpoint_name(x @ gate.astype(dtype), "mlpwi")
    up = checkpoint_name(x @ up.astype(dtype), "mlpwi")
    return checkpoint_name((activation(gate) * up) @ down.astype(dtype), "mlpwo")


class DecoderLayer(nnx.Module):
    """An attention layer, or with `linear` a Gated DeltaNet one (its `attend` a mix)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, linear: bool = False):
        self.attention_norm = RMSNorm(cfg.d_model, cfg)
        self.attention = (GatedDeltaNet if linear else Attention)(cfg, rngs)
        self.attention_post_norm = _optional_norm(cfg.post_norms, cfg.d_model, cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg, rngs)
        self.mlp_post_norm = _optional_norm(cfg.post_norms, cfg.d_model, cfg)

    def __call__(self, x, positions, segment_ids, rotary, attend: Attend,
                 mlp_chunks: TokenChunks | None = None,
                 gather_weight: GatherWeight = lambda w, axes, dtype: w):
        attended = self.attention(self.attention_norm(x), positions, segment_ids, rotary, attend)
        x = x + _normed(self.attention_post_norm, attended)
        return x + _normed(self.mlp_post_norm,
                          self.mlp(self.mlp_norm(x), mlp_chunks, gather_weight))


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, count: int,
                    linear: bool = False) -> DecoderLayer | None:
    """`count` decoder layers as one module whose parameters have a leading 'layers' axis
    (None for none)."""
    if not count:
        return None
    keys = jax.random.split(rngs.params(), count)
    states = jax.vmap(lambda key: nnx.state(DecoderLayer(cfg, nnx.Rngs(key), linear)))(keys)
    states = jax.tree.map(lambda p: p.replace(axes=("layers", *p.axes)), states,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderLayer(cfg, nnx.Rngs(0), linear)))
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
        # Attention layers (global, sliding) in one stack, linear ones in another: their
        # parameters differ. A model without linear layers has no linear_layers.
        linear = cfg.layer_kinds().count("linear")
        self.layers = _stacked_layers(cfg, rngs, cfg.layers - linear)
        if linear:
            self.linear_layers = _stacked_layers(cfg, rngs, linear, linear=True)
        self.final_norm = RMSNorm(cfg.d_model, cfg)
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
                 gather_weight: GatherWeight = lambda w, axes, dtype: w,
                 layers_per_checkpoint: int = 1, layer_input_pieces: int = 1) -> jax.Array:
        """Final (normalized) hidden states [b, s, d_model] in the compute dtype.

        `attend` maps each layer kind to its attention (bound to the kind's window); one
        callable serves a model whose layers are all global. `split_tokens` pins a
        [b, s, ...] activation to the devices holding its tokens (the strategy's sharding
        constraint); without it XLA may, e.g., build the rotary tables for the whole
        sequence on every device. `mlp_chunks` runs each MLP one chunk of tokens at a time
        (remat.mlp_chunk_tokens), with its weights from `gather_weight`.
        `layers_per_checkpoint` > 1 saves one layer input in that many
        (remat.layers_per_checkpoint; global layers only); `layer_input_pieces` names the
        saved layer input in that many slices of its features (`layer_input`)."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = split_tokens(jnp.take(self.embedding[...], tokens, axis=0).astype(dtype))
        if self.cfg.embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embedding_scale, dtype)
        kinds = self.cfg.layer_kinds()
        attends = _attends_by_kind(attend, set(kinds))
        rotary = {kind: tuple(map(split_tokens, rotary_tables(positions,
                                                              kind_config(self.cfg, kind))))
                  for kind in attends if kind != "linear"}
        stacks = {name: nnx.split(getattr(self, name)) for name in set(map(_stack, kinds))}

        def one_layer(kind: str) -> Callable:
            graphdef = stacks[_stack(kind)][0]

            def apply(x, layer_state):
                layer = nnx.merge(graphdef, layer_state)
                return split_tokens(layer(x, positions, segment_ids, rotary.get(kind),
                                          attends[kind], mlp_chunks, gather_weight))

            return apply

        remat = (lambda fn, prevent_cse=False: fn) if remat_policy is None else (
            lambda fn, prevent_cse=False: jax.checkpoint(fn, policy=remat_policy,
                                                         prevent_cse=prevent_cse))
        layer_fns = {kind: one_layer(kind) for kind in attends}
        name_input = functools.partial(layer_input, pieces=layer_input_pieces)
        if layers_per_checkpoint > 1:
            x = scan_layer_groups(x, stacks["layers"][1], layer_fns["global"], remat,
                                  layers_per_checkpoint, name_input)
        else:
            x = scan_layers_by_kind(x, {name: state for name, (_, state) in stacks.items()},
                                    kinds, layer_fns, _stack, remat, name_input)
        return self.final_norm(x)


def _stack(kind: str) -> str:
    """The Transformer attribute holding the stacked layers of `kind`."""
    return "linear_layers" if kind == "linear" else "layers"


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
