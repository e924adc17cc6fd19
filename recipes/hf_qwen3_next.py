"""A Qwen3-Next config.json (`Qwen3NextForCausalLM`) read as model keys: its full-attention
layers gated, with q/k norms and norms centred on 0 (hf_config.family_layers), RoPE on a
share of each head (partial_rotary_factor), and Gated DeltaNet layers (`kind: linear`)
in the order of layer_types; and written back (qwen3_next_json). lctrain builds its MLPs
dense: a config whose layers have experts (num_experts, every decoder_sparse_step-th
layer not in mlp_only_layers) is refused. Pure Python, as hf_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hf_layers import layer_kinds_from, pattern_groups
from .schema import ModelConfig, RecipeError

QWEN3_NEXT_KINDS = {"linear_attention": "linear", "full_attention": "global"}
QWEN3_NEXT_TYPES = {kind: name for name, kind in QWEN3_NEXT_KINDS.items()}


def qwen3_next_fields(config: dict, source: Path) -> dict[str, Any]:
    _check_dense(config, source)
    if config.get("attention_bias"):
        raise RecipeError(f"{source}: attention_bias true is not supported; lctrain's "
                          f"Qwen3-Next attention has no biases")
    rope = config.get("rope_parameters") or {}
    kinds = layer_kinds_from(config, source, QWEN3_NEXT_KINDS, "full_attention_interval", 4,
                             "lctrain's Qwen3-Next layers")
    return dict(
        # transformers' default when the config gives none is 0.25.
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             config.get("partial_rotary_factor", 0.25))),
        linear_key_heads=config["linear_num_key_heads"],
        linear_value_heads=config["linear_num_value_heads"],
        linear_key_head_dim=config["linear_key_head_dim"],
        linear_value_head_dim=config["linear_value_head_dim"],
        linear_conv_kernel=config["linear_conv_kernel_dim"],
        layer_pattern=None if set(kinds) == {"global"} else pattern_groups(kinds))


def _check_dense(config: dict, source: Path) -> None:
    experts = config.get("num_experts") or 0
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    sparse = [i for i in range(config["num_hidden_layers"])
              if experts > 0 and i not in dense and (i + 1) % step == 0]
    if sparse:
        raise RecipeError(f"{source}: num_experts {experts} puts experts in layer {sparse[0]} "
                          f"({len(sparse)} layers in all); lctrain's Qwen3-Next MLPs are "
                          f"dense: import a model with num_experts 0 or every layer in "
                          f"mlp_only_layers")


def qwen3_next_json(cfg: ModelConfig) -> dict[str, Any]:
    """The keys a Qwen3-Next config.json adds to Llama's: its layers in order, the Gated
    DeltaNet sizes, the share of RoPE, and dense MLPs (no experts)."""
    return {"hidden_act": "silu", "attention_bias": False,
            "partial_rotary_factor": cfg.partial_rotary_factor,
            "layer_types": [QWEN3_NEXT_TYPES[kind] for kind in cfg.layer_kinds()],
            "linear_num_key_heads": cfg.linear_key_heads,
            "linear_num_value_heads": cfg.linear_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel,
            "num_experts": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}
