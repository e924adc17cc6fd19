"""The model's arithmetic from its config alone: its parameters, as
trainer/model/transformer.py creates them, the keys a query attends to, the FLOPs a
training token costs, the bytes of an element. The planner and the trainer both read it,
so the trainer imports nothing of the planner's."""

from __future__ import annotations

import dataclasses
import math

from lctrain.recipes.schema import ModelConfig

BYTES = {"bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]   # logical axis names (trainer/model/transformer.py)
    layers: int                    # how many layers hold one (0: not a layer's)

    @property
    def per_layer(self) -> bool:
        return self.layers > 0


def parameter_tensors(m: ModelConfig) -> list[Tensor]:
    """The model's parameters as trainer/model/transformer.py creates them (layers stacked):
    the one inventory that the planner, the parameter count and the FLOP count read."""
    e, h, kv, d, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab
    linear = m.layer_kinds().count("linear")
    attention = m.layers - linear
    tensors = [
        Tensor("embedding", (v, e), ("vocab", "embed"), 0),
        Tensor("attention_norm", (e,), ("embed",), m.layers),
        Tensor("mlp_norm", (e,), ("embed",), m.layers),
        Tensor("gate", (e, f), ("embed", "mlp"), m.layers),
        Tensor("up", (e, f), ("embed", "mlp"), m.layers),
        Tensor("down", (f, e), ("mlp", "embed"), m.layers),
        Tensor("final_norm", (e,), ("embed",), 0),
    ]
    if attention:
        tensors += [
            Tensor("wq", (e, h, d), ("embed", "heads", "head_dim"), attention),
            Tensor("wk", (e, kv, d), ("embed", "kv_heads", "head_dim"), attention),
            Tensor("wv", (e, kv, d), ("embed", "kv_heads", "head_dim"), attention),
            Tensor("wo", (h, d, e), ("heads", "head_dim", "embed"), attention)]
    if attention and m.qkv_bias:  # Qwen2
        tensors += [Tensor("bq", (h, d), ("heads", "head_dim"), attention),
                    Tensor("bk", (kv, d), ("kv_heads", "head_dim"), attention),
                    Tensor("bv", (kv, d), ("kv_heads", "head_dim"), attention)]
    if attention and m.attention_output_gate:  # Qwen3-Next
        tensors.append(Tensor("wg", (e, h, d), ("embed", "heads", "head_dim"), attention))
    if attention and m.qk_norm:
        tensors += [Tensor(name, (d,), ("head_dim",), attention) for name in ("q_norm", "k_norm")]
    if m.post_norms:
        tensors += [Tensor(name, (e,), ("embed",), m.layers)
                    for name in ("attention_post_norm", "mlp_post_norm")]
    if linear:
        tensors += linear_tensors(m, linear)
    if not m.tie_embeddings:
        tensors.append(Tensor("unembedding", (e, v), ("embed", "vocab"), 0))
    return tensors


def linear_tensors(m: ModelConfig, layers: int) -> list[Tensor]:
    """A Gated DeltaNet's parameters (trainer/model/gdn_layer.GatedDeltaNet), in `layers`
    layers."""
    e, kernel = m.d_model, m.linear_conv_kernel
    hk, hv, dk, dv = (m.linear_key_heads, m.linear_value_heads, m.linear_key_head_dim,
                      m.linear_value_head_dim)
    keys, values = ("kv_heads", "head_dim"), ("heads", "head_dim")
    return [Tensor(name, shape, axes, layers) for name, shape, axes in [
        ("linear_wq", (e, hk, dk), ("embed", *keys)), ("linear_wk", (e, hk, dk), ("embed", *keys)),
        ("linear_wv", (e, hv, dv), ("embed", *values)),
        ("linear_wz", (e, hv, dv), ("embed", *values)),
        ("linear_wb", (e, hv), ("embed", "heads")), ("linear_wa", (e, hv), ("embed", "heads")),
        ("linear_conv_q", (kernel, hk, dk), (None, *keys)),
        ("linear_conv_k", (kernel, hk, dk), (None, *keys)),
        ("linear_conv_v", (kernel, hv, dv), (None, *values)),
        ("linear_dt_bias", (hv,), ("heads",)), ("linear_a_log", (hv,), ("heads",)),
        ("linear_norm_scale", (dv,), ("head_dim",)),
        ("linear_wo", (hv, dv, e), (*values, "embed"))]]


def count_parameters(model: ModelConfig) -> int:
    return sum(math.prod(t.shape) * max(t.layers, 1) for t in parameter_tensors(model))



def keys_per_query(cfg: ModelConfig, seq_len: int) -> float:
    """Keys a query attends to, on average over the layers, in units of a causal global
    layer's s/2: a sliding query at position p sees min(window, p + 1) keys."""
    total = 0.0
    for kind in cfg.layer_kinds():
        if kind == "linear":
            continue
        window = cfg.layer_group(kind).window
        if window is None or window >= seq_len:
            total += 1
        else:
            total += (window - window * (window - 1) / (2 * seq_len)) / (seq_len / 2)
    return total / cfg.layers



def attention_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """A token's attention matmuls (q.k and p.v) forward: a causal global layer does half
    of the s x s work, a sliding one its window's, a linear one none (its delta rule, O(d_k
    d_v) per token and head, is not counted)."""
    causal = 2 * cfg.layers * seq_len * cfg.n_heads * cfg.head_dim
    return causal * keys_per_query(cfg, seq_len)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one token's forward and backward (no recompute): 6 x parameters for
    the matmuls, plus three times the attention forward (MFU's numerator)."""
    return 6 * count_parameters(cfg) + 3 * attention_forward_flops_per_token(cfg, seq_len)
