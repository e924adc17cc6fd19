"""Rotary position embeddings: the frequencies of each model.rope_scaling type (none,
linear, llama3, yarn) as transformers defines them, the cos/sin tables and the rotation.

With model.layer_pattern each layer kind may have its own base frequency and may leave
model.rope_scaling out (scale_rope: Gemma 3 stretches only its global layers).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lctrain.recipes.schema import ModelConfig, RopeScalingConfig


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Per-pair rotation speeds and the scale of cos/sin, as transformers defines them for
    each model.rope_scaling type. Computed in float64 from the recipe alone (constants)."""
    half = np.arange(0, cfg.rotary_dim, 2, dtype=np.float64) / cfg.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** half
    scaling = cfg.rope_scaling
    if scaling.type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if scaling.type == "yarn":
        return _yarn_frequencies(inv_freq, cfg.rotary_dim, cfg.rope_theta, scaling)
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
    """The model as one kind's layers see it: their model.layer_pattern rope_theta, and no
    RoPE scaling where the kind's scale_rope is off."""
    group = cfg.layer_group(kind)
    if group.rope_theta is not None:
        cfg = dataclasses.replace(cfg, rope_theta=group.rope_theta)
    if not group.scale_rope:
        cfg = dataclasses.replace(cfg, rope_scaling=RopeScalingConfig(type="none"))
    return cfg


def apply_rope(x: jax.Array, rotary: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates [b, s, heads, d] by the rotary tables (rotate-half convention) over its
    first 2 x (the tables' width) features; the others pass (model.partial_rotary_factor)."""
    cos, sin = rotary
    rotated_dim = 2 * cos.shape[-1]
    first, second = jnp.split(x[..., :rotated_dim].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    if rotated_dim == x.shape[-1]:
        return rotated.astype(x.dtype)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotated_dim:]], axis=-1)
