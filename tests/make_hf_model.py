"""Makes a small randomly initialised Hugging Face model folder with transformers itself
(config.json + safetensors), the reference the import, export and workflow tests use.
Nothing is downloaded.

    python tests/make_hf_model.py OUT_DIR [--family llama|mistral|qwen2] [--vocab N] ...
"""

from __future__ import annotations

import argparse
from pathlib import Path

# config.json of meta-llama/Llama-3.1-8B as the hub serves it (rope_theta + rope_scaling).
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}

CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def make_hf_model(folder: str | Path, family: str = "llama", *, layers: int = 2,
                  hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 160,
                  vocab: int = 256, head_dim: int | None = None, rope_theta: float = 10_000.0,
                  rope_scaling: dict | None = None, tie: bool = False,
                  max_positions: int = 2048, dtype: str = "float32", seed: int = 0,
                  init_range: float = 0.1):
    """Saves the model into `folder` and returns it (PyTorch, float32, eval mode)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in CLASSES[family])
    extra = {"head_dim": head_dim} if head_dim else {}
    config = config_class(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
        max_position_embeddings=max_positions, tie_word_embeddings=tie,
        initializer_range=init_range,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        **extra)
    return _save_random(model_class, config, folder, dtype, seed)


def make_gemma3_model(folder: str | Path, *, layer_types: list[str], sliding_window: int,
                      hidden: int = 64, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                      ffn: int = 160, vocab: int = 256, query_pre_attn_scalar: int = 24,
                      rope_theta: float = 1e6, local_theta: float = 1e4,
                      rope_scaling: dict | None = None, tie: bool = True,
                      dtype: str = "float32", seed: int = 0, init_range: float = 0.1):
    """A Gemma 3 text model (Gemma3ForCausalLM): `layer_types` of sliding_attention /
    full_attention, `rope_scaling` on the full_attention layers only, as transformers
    does. Saved into `folder` and returned (PyTorch, float32, eval mode)."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=len(layer_types), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, layer_types=layer_types,
        sliding_window=sliding_window, query_pre_attn_scalar=query_pre_attn_scalar,
        tie_word_embeddings=tie, initializer_range=init_range, max_position_embeddings=2048,
        attn_implementation="eager",
        rope_parameters={
            "full_attention": {"rope_type": "default", **(rope_scaling or {}),
                               "rope_theta": rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}})
    return _save_random(transformers.Gemma3ForCausalLM, config, folder, dtype, seed)


def make_qwen3_next_model(folder: str | Path, *, layer_types: list[str], hidden: int = 64,
                          heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                          rotary_factor: float = 0.25, key_heads: int = 2, value_heads: int = 4,
                          key_head_dim: int = 8, value_head_dim: int = 8, conv_kernel: int = 4,
                          ffn: int = 160, vocab: int = 256, dtype: str = "float32",
                          seed: int = 0, init_range: float = 0.1):
    """A dense Qwen3-Next (Qwen3NextForCausalLM, num_experts 0): `layer_types` of
    linear_attention / full_attention. Saved into `folder` and returned (PyTorch,
    float32, eval mode)."""
    import transformers

    config = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=len(layer_types), layer_types=layer_types,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=key_head_dim, linear_value_head_dim=value_head_dim,
        linear_conv_kernel_dim=conv_kernel, num_experts=0, tie_word_embeddings=False,
        initializer_range=init_range, max_position_embeddings=2048, rms_norm_eps=1e-6,
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": rotary_factor})
    return _save_random(transformers.Qwen3NextForCausalLM, config, folder, dtype, seed)


def _save_random(model_class, config, folder, dtype: str, seed: int):
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # nonzero norm scales and biases, so the test sees them
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "bias")):
                parameter.add_(0.1 * torch.randn_like(parameter))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return model.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(CLASSES), default="llama")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-positions", type=int, default=256)
    args = parser.parse_args()
    make_hf_model(args.out, args.family, vocab=args.vocab, layers=args.layers,
                  max_positions=args.max_positions)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
