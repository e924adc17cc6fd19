"""The model section of the recipe schema (model.*): the architecture, its presets, RoPE
scaling and the layer pattern. Re-exported by schema.py.

Like schema.py, this module must not import jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .options import option


LLAMA31_ROPE_SCALING = dict(type="llama3", factor=8.0, original_max_position_embeddings=8192,
                            low_freq_factor=1.0, high_freq_factor=4.0)

# Every model field a preset (or an imported config.json) must give; head_dim None means
# d_model / n_heads.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(family="llama", layers=2, d_model=128, n_heads=8, n_kv_heads=2, head_dim=None,
                 d_ff=384, vocab=128, qkv_bias=False, rope_theta=10_000.0,
                 rope_scaling=dict(type="none"), max_position_embeddings=8192,
                 tie_embeddings=False, norm_eps=1e-5),
    "llama3.1-8b": dict(family="llama", layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                        head_dim=None, d_ff=14336, vocab=128256, qkv_bias=False,
                        rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING,
                        max_position_embeddings=131072, tie_embeddings=False, norm_eps=1e-5),
    "llama3.1-70b": dict(family="llama", layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
                         head_dim=None, d_ff=28672, vocab=128256, qkv_bias=False,
                         rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING,
                         max_position_embeddings=131072, tie_embeddings=False, norm_eps=1e-5),
}

# The keys that make a preset's shape: a recipe that changes one trains another model.
SHAPE_KEYS = ("family", "layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab",
              "qkv_bias", "tie_embeddings")

# Model keys that may differ from an imported config.json on purpose: changing RoPE is how
# a pretrained model's context is extended.
ROPE_KEYS = ("rope_theta", "rope_scaling")

# The model.rope_scaling keys each type reads (type itself aside); a key given that its type
# does not read is refused rather than ignored ({factor: 4} alone on a model without scaling
# would otherwise train at the old RoPE).
ROPE_SCALING_KEYS = {
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "truncate"),
}



def read_rope_scaling_keys(scaling: dict[str, Any]) -> dict[str, Any]:
    """model.rope_scaling as YAML, with only the keys its type reads."""
    kind = scaling.get("type", "none")
    return {key: value for key, value in scaling.items()
            if key == "type" or key in ROPE_SCALING_KEYS.get(kind, ())}


# The kinds of layer model.layer_pattern mixes; a model without one is all global.
LAYER_KINDS = ("global", "sliding", "linear")


@dataclass(frozen=True)
class RopeScalingConfig:
    type: Literal["none", "linear", "llama3", "yarn"] = option(
        "none", "How positions are stretched past the context the model was trained for, as "
                "transformers defines each: none, linear (every frequency / factor), llama3 "
                "(Llama 3.1: low frequencies / factor, high kept, smooth between) or yarn "
                "(ramp between the two by rotations, and cos/sin scaled by attention_factor).")
    factor: float = option(1.0, "Context multiple the scaling aims at (linear, llama3, yarn).")
    original_max_position_embeddings: int | None = option(
        None, "Context the frequencies were trained for (llama3, yarn); null takes "
              "model.max_position_embeddings.")
    low_freq_factor: float = option(
        1.0, "llama3: wavelengths longer than original / low_freq_factor are divided by factor.")
    high_freq_factor: float = option(
        4.0, "llama3: wavelengths shorter than original / high_freq_factor are kept.")
    beta_fast: float = option(32.0, "yarn: rotations above which a frequency is kept.")
    beta_slow: float = option(1.0, "yarn: rotations below which a frequency is divided by factor.")
    attention_factor: float | None = option(
        None, "yarn: scale of cos and sin; null takes 0.1 * ln(factor) + 1.")
    truncate: bool = option(True, "yarn: round the ramp's ends to whole dimensions.")


@dataclass(frozen=True)
class LayerGroupConfig:
    """One group of model.layer_pattern: `count` consecutive layers of one kind."""
    kind: Literal[LAYER_KINDS] = option(
        "global", "global: causal attention over the whole sequence (as without a pattern); "
                  "sliding: each query sees only the `window` latest tokens of its document, "
                  "itself included (transformers' sliding_window); linear: Qwen3-Next's Gated "
                  "DeltaNet (a causal conv and the gated delta rule's state in place of "
                  "attention, keys model.linear_*).")
    count: int = option(1, "Consecutive layers of this kind.")
    window: int | None = option(
        None, "sliding only, and required there: key j is seen by query i iff position(i) - "
              "position(j) < window. Every group of one kind gives the same window.")
    rope_theta: float | None = option(
        None, "RoPE base frequency of this kind's layers (Gemma 3: 10000 on sliding layers, "
              "1e6 on global ones); null takes model.rope_theta.")
    scale_rope: bool = option(
        True, "Whether model.rope_scaling applies to this kind's layers (Gemma 3 stretches only "
              "its global layers' RoPE: false on sliding ones).")


@dataclass(frozen=True)
class ModelConfig:
    init: str = option(
        "random", "'random' (seeded by train.seed), or 'hf:<dir>': a Hugging Face model folder "
                  "(config.json + *.safetensors), whose config.json gives every key below "
                  "(they must agree with it or be unset; rope_theta and rope_scaling may "
                  "differ on purpose: that is how a context is extended).")
    preset: Literal["tiny", "llama3.1-8b", "llama3.1-70b"] = option(
        "tiny", "Architecture preset for model.init=random; the keys below override single "
                "values of it.")
    family: Literal["llama", "mistral", "qwen2", "gemma3", "qwen3_next"] | None = option(
        None, "Hugging Face architecture written by `lctrain export` (Llama, Mistral, Qwen2, "
              "Gemma 3 text, Qwen3-Next with dense MLPs).")
    layers: int | None = option(None, "Decoder layers (scanned, so compile time does not grow).")
    d_model: int | None = option(None, "Hidden width.")
    n_heads: int | None = option(None, "Query heads.")
    n_kv_heads: int | None = option(None, "Key/value heads (GQA when fewer than n_heads).")
    head_dim: int | None = option(None, "Width of one head; null means d_model / n_heads.")
    d_ff: int | None = option(None, "Gated MLP inner width.")
    vocab: int | None = option(None, "Vocabulary size.")
    qkv_bias: bool | None = option(None, "Biases on the q, k and v projections (Qwen2).")
    rope_theta: float | None = option(None, "RoPE base frequency.")
    rope_scaling: RopeScalingConfig | None = option(
        None, "RoPE scaling, model.rope_scaling.* below; keys given merge over the preset's "
              "or config.json's unless the type changes.")
    max_position_embeddings: int | None = option(
        None, "Context the model was made for (config.json's); export writes the larger of "
              "it and data.seq_len.")
    tie_embeddings: bool | None = option(None, "Share the input embedding with the unembedding.")
    dtype: Literal["bfloat16", "float32"] = option(
        "bfloat16", "Compute dtype; master weights and optimizer state stay float32.")
    norm_eps: float | None = option(None, "RMSNorm epsilon.")
    norm_offset: float = option(
        0.0, "RMSNorm multiplies by (norm_offset + its weight): 0 as Llama, 1 as Gemma (whose "
             "norm weights are stored, and initialised, centred on 0).")
    qk_norm: bool = option(
        False, "RMSNorm over each query and key head (a weight of head_dim each) before RoPE "
               "(Gemma 3, Qwen3).")
    post_norms: bool = option(
        False, "Also RMSNorm each sublayer's output before it joins the residual (Gemma 2 and "
               "3: four norms per layer).")
    mlp_activation: Literal["silu", "gelu_tanh"] = option(
        "silu", "Gate activation of the gated MLP: silu (SwiGLU, Llama) or gelu_tanh (GeGLU, "
                "tanh approximation: Gemma's gelu_pytorch_tanh).")
    embedding_scale: float = option(
        1.0, "Multiplies the input embeddings, rounded to model.dtype as transformers does "
             "(Gemma: sqrt(d_model)); the tied output matrix stays unscaled.")
    query_pre_attn_scalar: int | None = option(
        None, "Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma's name for "
              "it); null: head_dim, the usual 1 / sqrt(head_dim).")
    partial_rotary_factor: float = option(
        1.0, "Share of each query and key head RoPE rotates, its first head_dim x this "
             "features (an even count); the rest pass unrotated (Qwen3-Next: 0.25).")
    attention_output_gate: bool = option(
        False, "Multiply attention's output, per head and feature, by sigmoid of a gate "
               "projection of the layer's input before the output projection (Qwen3-Next).")
    linear_key_heads: int = option(
        16, "linear layers: heads of q and k (Qwen3-Next's linear_num_key_heads).")
    linear_value_heads: int = option(
        32, "linear layers: heads of v, the output gate, g and beta, a multiple of "
            "linear_key_heads (linear_num_value_heads).")
    linear_key_head_dim: int = option(128, "linear layers: width of a q or k head.")
    linear_value_head_dim: int = option(128, "linear layers: width of a v head.")
    linear_conv_kernel: int = option(
        4, "linear layers: taps of the causal depthwise conv over q, k, v (the token and "
           "the kernel - 1 before it, within its document).")
    linear_chunk: int = option(
        64, "linear layers: tokens per chunk of the chunked delta rule (kernels/gdn.py); "
            "only speed and memory depend on it.")
    layer_pattern: list[LayerGroupConfig] | None = option(
        None, "Mixed attention layers (Gemma 3: 5 sliding, 1 global): a list of {kind, count, "
              "window, rope_theta} groups, keys below, repeated from the first layer over "
              "model.layers (a last, partial repeat takes the pattern's first layers); null: "
              "every layer global. Layers stay scanned: compile time grows with the pattern's "
              "length, not with depth.")

    @property
    def rotary_dim(self) -> int:
        """The features of a head RoPE rotates (model.partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def pattern_kinds(self) -> list[str]:
        """One repeat of model.layer_pattern, a kind per layer (global without one)."""
        return [group.kind for group in self.layer_pattern or ()
                for _ in range(group.count)] or ["global"]

    def layer_kinds(self) -> list[str]:
        """The kind of every layer, first to last: the pattern repeated over model.layers."""
        pattern = self.pattern_kinds()
        return [pattern[i % len(pattern)] for i in range(self.layers)]

    def switches_layer_kinds(self) -> bool:
        """Whether the model's layer scan picks each layer's kind with a switch: several
        kinds (trainer/model/layer_scan.scan_layers_by_kind)."""
        return len(set(self.layer_kinds())) > 1

    def layer_group(self, kind: str) -> LayerGroupConfig:
        """The settings (window, rope_theta) of `kind`'s layers: its first group's, which
        every other group of the kind repeats (checked at load)."""
        return next((group for group in self.layer_pattern or () if group.kind == kind),
                    LayerGroupConfig(kind=kind))

    @property
    def name(self) -> str:
        """What the model is, for logs: the folder it was imported from, its preset, or
        "custom" where the recipe changed the preset's architecture."""
        if self.hf_dir:
            return self.init
        preset = MODEL_PRESETS[self.preset]
        head_dim = preset["head_dim"] or preset["d_model"] // preset["n_heads"]
        changed = self.head_dim != head_dim or any(
            getattr(self, key) != preset[key] for key in SHAPE_KEYS)
        return f"custom (from {self.preset})" if changed else self.preset

    @property
    def hf_dir(self) -> str | None:
        """The Hugging Face folder of model.init=hf:<dir>, else None."""
        return self.init.removeprefix("hf:") if self.init.startswith("hf:") else None
