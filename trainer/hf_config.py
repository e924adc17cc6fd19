"""A Hugging Face `config.json` read as lctrain's model keys, and written back from them.

Pure Python (no jax): the recipe loader reads the config before jax starts. The hub's
checkpoints write RoPE as `rope_theta` plus `rope_scaling`; transformers 5 writes one
`rope_parameters` dict. Both are read; the hub's form is written, since every transformers
version reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lctrain.recipes.schema import ModelConfig, RecipeError

# architectures[0] -> model.family. Mistral is Llama without biases; Qwen2 adds q/k/v biases.
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2"}
ARCHITECTURES = {family: name for name, family in FAMILIES.items()}
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
    return dict(
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
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    )


def _family(config: dict, source: Path) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise RecipeError(f"{source}: architecture {', '.join(names) or '(none given)'} is not "
                      f"supported; lctrain imports {', '.join(FAMILIES)}")


def _check_supported(config: dict, family: str, source: Path, seq_len: int) -> None:
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


def _rope(config: dict, source: Path) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling) from either way a config writes RoPE."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    theta = config.get("rope_theta", parameters.get("rope_theta", 10_000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise RecipeError(f"{source}: RoPE type {rope_type!r} is not supported; lctrain knows "
                          f"{', '.join(ROPE_TYPES)} (set model.rope_scaling to override)")
    fields = {key: scaling[key] for key in ROPE_SCALING_KEYS if scaling.get(key) is not None}
    return theta, {"type": ROPE_TYPES[rope_type], **fields}


def check_exportable(cfg: ModelConfig) -> None:
    """RecipeError for a model whose layers a Llama/Mistral/Qwen2 config.json cannot
    describe: one with sliding-window layers (model.layer_pattern). Checked before any
    weight is read; exported anyway, a server would run every layer global."""
    if cfg.layer_pattern is not None and set(cfg.layer_kinds()) != {"global"}:
        raise RecipeError(
            f"recipe key 'model.layer_pattern' = {[g.kind for g in cfg.layer_pattern]}: "
            f"sliding-window layers have no place in a {cfg.family} config.json (its "
            f"layers all attend globally); lctrain exports models whose layers are all "
            f"global")


def config_json(cfg: ModelConfig, seq_len: int, dtype: str,
                special_tokens: dict[str, int] | None = None) -> dict[str, Any]:
    """The config.json of an exported model: its shapes and the RoPE it trained with."""
    config = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "hidden_act": "silu",
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
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_json(cfg),
        "torch_dtype": dtype,
        **(special_tokens or {}),
    }
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
