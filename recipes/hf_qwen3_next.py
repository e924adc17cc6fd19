"""A Qwen3-Next config.json (`Qwen3NextForCausalLM`) read as model keys: its full-attention
layers gated, with q/k norms and norms centred on 0 (hf_config.family_layers), RoPE on a
share of each head (partial_rotary_factor), and Gated DeltaNet layers (`kind: linear`)
in the order of layer_types; and written back (qwen3_next_json). lctrain builds its MLPs
dense: a config whose layers have experts (num_experts, every decoder_sparse_step-th
layer not in mlp_only_layers) is refused. Pure Python, as hf_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .schema import ModelConfig, RecipeError

QWEN3_NEXT_KINDS = {"linear_attention": "linear", "full_attention": "global"}
QWEN3_NEXT_TYPES = {kind: name for name, kind in QWEN3_NEXT_KINDS.items()}


def qwen3_next_fields(config: dict, source: Path) -> dict[str, Any]:
    _check_dense(config, source)
    if config.get("attention_bias"):
        raise RecipeError(f"{source}: attention_bias true is not supported; lctrain's "
                          f"Qwen3-Next attention has no biases")
    rope = config.get("rope_parameters") or {}
    kinds = _kinds(config, source)
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


def pattern_groups(kinds: list[str], extra: dict[str, dict] | None = None) -> list[dict]:
    """model.layer_pattern for the layers' kinds: their shortest repeat, as groups of
    consecutive layers of one kind (with `extra` keys per kind)."""
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(kind == kinds[i % p] for i, kind in enumerate(kinds)))
    groups: list[dict] = []
    for kind in kinds[:period]:
        if groups and groups[-1]["kind"] == kind:
            groups[-1]["count"] += 1
        else:
            groups.append(dict(kind=kind, count=1, **(extra or {}).get(kind, {})))
    return groups


def _kinds(config: dict, source: Path) -> list[str]:
    layers = config["num_hidden_layers"]
    every = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    unknown = [name for name in types if name not in QWEN3_NEXT_KINDS]
    if unknown:
        raise RecipeError(f"{source}: layer_types entry {unknown[0]!r} is not supported; "
                          f"lctrain's Qwen3-Next layers are {' or '.join(QWEN3_NEXT_KINDS)}")
    return [QWEN3_NEXT_KINDS[name] for name in types]


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
