"""A Hugging Face `config.json` read as lctrain's model keys, and written back from them.

Pure Python (no jax): the recipe loader reads the config before jax starts. The hub's
checkpoints write RoPE as `rope_theta` plus `rope_scaling`; transformers 5 writes one
`rope_parameters` dict (Gemma 3: one per layer type). Both are read; the hub's form is
written, since every transformers version reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .hf_layers import layer_kinds_from, pattern_groups
from .hf_qwen3_next import qwen3_next_fields, qwen3_next_json
from .schema import ModelConfig, RecipeError, require

# architectures[0] -> model.family. Mistral is Llama without biases; Qwen2 adds q/k/v biases;
# Gemma 3 (text only) the layer features of family_layers and sliding/global layers.
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3",
            "Qwen3NextForCausalLM": "qwen3_next"}
ARCHITECTURES = {family: name for name, family in FAMILIES.items()}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type, where not the family
# Gemma 3's layer_types -> model.layer_pattern kinds.
GEMMA3_KINDS = {"sliding_attention": "sliding", "full_attention": "global"}
GEMMA3_TYPES = {kind: name for name, kind in GEMMA3_KINDS.items()}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
ROPE_SCALING_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor",
                     "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "truncate")


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise RecipeError(f"recipe key 'model.init' = 'hf:{folder}': no such folder; give a "
                          f"Hugging Face model folder (config.json + *.safetensors)")
    if not path.is_file():
        raise RecipeError(f"{path}: missing; model.init=hf:<dir> needs the folder a Hugging "
                          f"Face model was saved to (config.json + *.safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(f"{path}: not valid JSON ({err}); re-save the model") from None


def model_fields(folder: str | Path, seq_len: int) -> dict[str, Any]:
    """The model.* keys the folder's config.json fixes (see schema.MODEL_PRESETS)."""
    config = read_config(folder)
    source = Path(folder) / "config.json"
    family = _family(config, source)
    _check_supported(config, family, source, seq_len)
    heads = config["num_attention_heads"]
    theta, scaling = _rope(config, source)
    gemma = family == "gemma3"
    fields = dict(
        family=family,
        layers=config["num_hidden_layers"],
        d_model=config["hidden_size"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        d_ff=config["intermediate_size"],
        vocab=config["vocab_size"],
        qkv_bias=family == "qwen2",
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", seq_len),
        tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        query_pre_attn_scalar=None,
        **family_layers(family, config["hidden_size"]),
    )
    if gemma:
        fields.update(_gemma3_fields(config, source))
    if family == "qwen3_next":
        fields.update(qwen3_next_fields(config, source))
    return fields


def family_layers(family: str, d_model: int) -> dict[str, Any]:
    """The model keys that say how a family's layers compute (Llama's defaults but for
    Gemma 3's); an export must match them."""
    llama = dict(norm_offset=0.0, qk_norm=False, post_norms=False, mlp_activation="silu",
                 embedding_scale=1.0, partial_rotary_factor=1.0, attention_output_gate=False)
    if family == "gemma3":
        return {**llama, **dict(norm_offset=1.0, qk_norm=True, post_norms=True,
                                mlp_activation="gelu_tanh", embedding_scale=d_model ** 0.5)}
    if family == "qwen3_next":  # its share of RoPE varies: model_fields reads it
        return {key: value for key, value in llama.items() if key != "partial_rotary_factor"
                } | dict(norm_offset=1.0, qk_norm=True, attention_output_gate=True)
    return llama


def _gemma3_fields(config: dict, source: Path) -> dict[str, Any]:
    """RoPE, attention scale and layer pattern of a Gemma 3 config.json: model.rope_theta
    and model.rope_scaling are the global layers' (transformers scales only those), the
    sliding layers' base frequency is rope_local_base_freq."""
    per_type = config.get("rope_parameters") or {}
    full, local = per_type.get("full_attention") or {}, per_type.get("sliding_attention") or {}
    theta, scaling = _rope({"rope_theta": config.get("rope_theta", full.get("rope_theta", 1e6)),
                            "rope_scaling": config.get("rope_scaling") or full}, source)
    local_type = local.get("rope_type", "default")
    if local_type != "default":
        raise RecipeError(f"{source}: rope_parameters.sliding_attention.rope_type "
                          f"{local_type!r} is not supported; lctrain scales only the global "
                          f"layers' RoPE, as transformers' rope_scaling does")
    local_theta = config.get("rope_local_base_freq", local.get("rope_theta", 10_000.0))
    return dict(rope_theta=float(theta), rope_scaling=scaling,
                query_pre_attn_scalar=int(config.get("query_pre_attn_scalar", 256)),
                layer_pattern=_gemma3_pattern(config, source, float(local_theta)))


def _gemma3_pattern(config: dict, source: Path, local_theta: float) -> list[dict] | None:
    """model.layer_pattern from layer_types (older configs: every sliding_window_pattern-th
    layer global): its shortest repeat, as groups of consecutive layers of one kind."""
    kinds = layer_kinds_from(config, source, GEMMA3_KINDS, "sliding_window_pattern", 6,
                             "lctrain's layers")
    if "sliding" not in kinds:
        return None
    window = config.get("sliding_window")
    if not window:
        raise RecipeError(f"{source}: sliding_window {window!r} with sliding_attention layers; "
                          f"give the window in tokens")
    sliding = dict(window=window, rope_theta=local_theta, scale_rope=False)
    return pattern_groups(kinds, {"sliding": sliding})


def _family(config: dict, source: Path) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise RecipeError(f"{source}: architecture {', '.join(names) or '(none given)'} is not "
                      f"supported; lctrain imports {', '.join(FAMILIES)}")


def _check_supported(config: dict, family: str, source: Path, seq_len: int) -> None:
    if family == "gemma3":
        _check_gemma3(config, source)
        return
    if config.get("hidden_act", "silu") != "silu":
        raise RecipeError(f"{source}: hidden_act {config['hidden_act']!r} is not supported; "
                          f"lctrain's MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if family == "llama" and config.get(key):
            raise RecipeError(f"{source}: {key} true is not supported for Llama; lctrain's "
                              f"Llama has no biases")
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", family == "mistral") and window < seq_len:
        raise RecipeError(f"{source}: sliding_window {window} is shorter than data.seq_len "
                          f"{seq_len}, and lctrain attends to the whole sequence; use "
                          f"data.seq_len <= {window}")


# Gemma 3 keys lctrain has no counterpart for, and the one value it runs.
GEMMA3_FIXED = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "attn_logit_softcapping": None, "final_logit_softcapping": None,
                "use_bidirectional_attention": False}


def _check_gemma3(config: dict, source: Path) -> None:
    for key, supported in GEMMA3_FIXED.items():
        value = config.get(key, supported)
        if value != supported and not (supported is False and value is None):
            raise RecipeError(f"{source}: {key} {value!r} is not supported; lctrain runs "
                              f"Gemma 3 text models with {key} {json.dumps(supported)}")


def _rope(config: dict, source: Path) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling) from either way a config writes RoPE."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    theta = config.get("rope_theta", parameters.get("rope_theta", 10_000.0))
    _require_rope_type(scaling, "rope_scaling" if config.get("rope_scaling") else
                       "rope_parameters", source)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise RecipeError(f"{source}: RoPE type {rope_type!r} is not supported; lctrain knows "
                          f"{', '.join(ROPE_TYPES)} (set model.rope_scaling to override)")
    fields = {key: scaling[key] for key in ROPE_SCALING_KEYS if scaling.get(key) is not None}
    return theta, {"type": ROPE_TYPES[rope_type], **fields}


def _require_rope_type(scaling: dict, key: str, source: Path) -> None:
    """A scaling key without a type would be read as no scaling, silently (as
    model.rope_scaling in a recipe is refused: recipes/loader._require_read_by)."""
    given = [name for name in ROPE_SCALING_KEYS if scaling.get(name) is not None]
    if given and "rope_type" not in scaling and "type" not in scaling:
        raise RecipeError(
            f"{source}: {key} gives {', '.join(f'{name} {scaling[name]!r}' for name in given)} "
            f"but no rope_type, so it would be read as unscaled RoPE; add \"rope_type\" "
            f"(linear, llama3 or yarn) to {key}, or remove {', '.join(given)}")


def check_exportable(cfg: ModelConfig) -> None:
    """RecipeError for a model whose layers its family's config.json cannot describe: layer
    features other than the family's (family_layers), another attention scale, or
    sliding-window layers, outside Gemma 3; linear layers outside Qwen3-Next; on Gemma 3,
    RoPE scaling on other layers than the global ones. Checked before any weight is read; exported anyway, a server would run
    another model."""
    for key, value in family_layers(cfg.family, cfg.d_model).items():
        require(getattr(cfg, key) == value, f"model.{key}", getattr(cfg, key),
                f"a {cfg.family} config.json has {value!r} there; lctrain exports only what "
                f"the family's config.json describes")
    if cfg.family == "gemma3":
        _check_gemma3_rope(cfg)
        return
    require(cfg.query_pre_attn_scalar in (None, cfg.head_dim), "model.query_pre_attn_scalar",
            cfg.query_pre_attn_scalar, f"a {cfg.family} config.json scales attention by "
            f"1/sqrt(head_dim); set it to null")
    kinds = set(cfg.layer_kinds())
    if "sliding" in kinds:
        raise RecipeError(
            f"recipe key 'model.layer_pattern' = {[g.kind for g in cfg.layer_pattern]}: "
            f"sliding-window layers have no place in a {cfg.family} config.json (its "
            f"layers all attend globally); lctrain exports models whose layers are all "
            f"global")
    if "linear" in kinds and cfg.family != "qwen3_next":
        raise RecipeError(
            f"recipe key 'model.layer_pattern' = {[g.kind for g in cfg.layer_pattern]}: "
            f"a {cfg.family} config.json has no linear (Gated DeltaNet) layers; use "
            f"model.family qwen3_next with its layers (norm_offset 1, qk_norm, "
            f"attention_output_gate) or export a model whose layers are all global")


def _check_gemma3_rope(cfg: ModelConfig) -> None:
    if cfg.rope_scaling.type == "none":
        return
    for i, group in enumerate(cfg.layer_pattern or ()):
        require(group.scale_rope == (group.kind == "global"),
                f"model.layer_pattern[{i}].scale_rope", group.scale_rope,
                f"a gemma3 config.json scales the RoPE of global layers only; set it to "
                f"{str(group.kind == 'global').lower()}")


def _gemma3_json(cfg: ModelConfig) -> dict[str, Any]:
    sliding = cfg.layer_group("sliding")
    return {**GEMMA3_FIXED, "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "layer_types": [GEMMA3_TYPES[kind] for kind in cfg.layer_kinds()],
            "sliding_window": sliding.window,
            "rope_local_base_freq": sliding.rope_theta or cfg.rope_theta}


def config_json(cfg: ModelConfig, seq_len: int, dtype: str,
                special_tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """The config.json of an exported model: its shapes and the RoPE it trained with."""
    config = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": MODEL_TYPES.get(cfg.family, cfg.family),
        "num_hidden_layers": cfg.layers,
        "hidden_size": cfg.d_model,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "vocab_size": cfg.vocab,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": max(cfg.max_position_embeddings, seq_len),
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.layer_group("global").rope_theta or cfg.rope_theta,
        "rope_scaling": _rope_scaling_json(cfg),
        "torch_dtype": dtype,
        **(special_tokens or {}),
    }
    config.update(_gemma3_json(cfg) if cfg.family == "gemma3" else
                  qwen3_next_json(cfg) if cfg.family == "qwen3_next" else {"hidden_act": "silu"})
    if cfg.family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if cfg.family in ("mistral", "qwen2"):
        config.update(sliding_window=None, use_sliding_window=False)
    return config


def _rope_scaling_json(cfg: ModelConfig) -> dict[str, Any] | None:
    scaling = cfg.rope_scaling
    if scaling.type == "none":
        return None
    keys = {"linear": ("factor",),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                       "high_freq_factor"),
            "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                     "attention_factor", "truncate")}[scaling.type]
    values = {key: getattr(scaling, key) for key in keys if getattr(scaling, key) is not None}
    return {"rope_type": scaling.type, **values}
