"""Recipe checks of linear (Gated DeltaNet) layers: their model.linear_* keys, and their
strategy (state_passing, or none where the sequence is not split; that state_passing runs
nothing else is recipes/loader's check of every kind-only strategy)."""

from __future__ import annotations

from .schema import LINEAR_STRATEGIES, ModelConfig, Recipe, require

LINEAR_SIZES = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel", "linear_chunk")


def validate_linear_layers(recipe: Recipe) -> None:
    m = recipe.model
    kinds = set(m.layer_kinds())
    if "linear" not in kinds:
        return
    _validate_linear_keys(m)
    name = recipe.parallel.by_kind(kinds)["linear"]
    require(name in LINEAR_STRATEGIES,
            "parallel.strategy" + (".linear" if isinstance(recipe.parallel.strategy, dict)
                                   else ""), name,
            "linear (Gated DeltaNet) layers run on state_passing (none where mesh.context "
            "is 1), not on an attention strategy; give them "
            "parallel.strategy={linear: state_passing, ...}")


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
