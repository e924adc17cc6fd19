"""Recipe checks of linear (Gated DeltaNet) layers: their model.linear_* keys, and the
strategies of the layer kinds (state_passing runs linear layers only, and they run on it,
or on none where the sequence is not split)."""

from __future__ import annotations

from .schema import (LINEAR_ONLY_STRATEGIES, LINEAR_STRATEGIES, ModelConfig, Recipe,
                     require)

LINEAR_SIZES = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel", "linear_chunk")


def validate_linear_layers(recipe: Recipe) -> None:
    m = recipe.model
    kinds = set(m.layer_kinds())
    if "linear" in kinds:
        _validate_linear_keys(m)
    strategy = recipe.parallel.strategy
    for kind, name in recipe.parallel.by_kind(kinds).items():
        key = "parallel.strategy" + (f".{kind}" if isinstance(strategy, dict) else "")
        if kind == "linear":
            require(name in LINEAR_STRATEGIES, key, name,
                    f"linear (Gated DeltaNet) layers run on state_passing (none where "
                    f"mesh.context is 1), not on an attention strategy; give them "
                    f"parallel.strategy={{linear: state_passing, ...}}")
        else:
            require(name not in LINEAR_ONLY_STRATEGIES, key, name,
                    f"{name} runs linear layers only, and the model has {kind} layers; give "
                    f"them another, e.g. parallel.strategy={{{kind}: ring, linear: {name}}}")


def _validate_linear_keys(m: ModelConfig) -> None:
    for name in LINEAR_SIZES:
        require(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be positive")
    require(m.linear_value_heads % m.linear_key_heads == 0, "model.linear_value_heads",
            m.linear_value_heads,
            f"must be a multiple of model.linear_key_heads ({m.linear_key_heads})")
    for i, group in enumerate(m.layer_pattern):
        if group.kind == "linear":
            require(group.rope_theta is None, f"model.layer_pattern[{i}].rope_theta",
                    group.rope_theta, "linear layers have no RoPE; remove it")
