"""The recipe schema: every option lctrain understands, its type, default and meaning.

This module must not import jax: the CLI reads the recipe (for example
`runtime.cpu_devices`) before jax initialises its backends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


class RecipeError(ValueError):
    """A recipe value that cannot work; the message names the key, the value and the fix."""


def option(default: Any, help: str) -> Any:
    """A recipe field with its one-line documentation (used for the README reference)."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(layers=2, d_model=128, n_heads=8, n_kv_heads=2, d_ff=384, vocab=128,
                 rope_theta=10_000.0, rope_scaling_factor=0.0, tie_embeddings=False),
    "llama3.1-8b": dict(layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                        vocab=128256, rope_theta=500_000.0, rope_scaling_factor=8.0,
                        tie_embeddings=False),
    "llama3.1-70b": dict(layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                         vocab=128256, rope_theta=500_000.0, rope_scaling_factor=8.0,
                         tie_embeddings=False),
}

REMAT_TENSORS = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj",
    "context", "out_proj", "mlpwi", "mlpwo",
)

STRATEGIES = ("none", "all_gather", "ulysses", "ring", "usp", "auto")


@dataclass
class ModelConfig:
    preset: Literal["tiny", "llama3.1-8b", "llama3.1-70b"] = option(
        "tiny", "Architecture preset; the fields below override single values of it.")
    layers: int | None = option(None, "Decoder layers (scanned, so compile time does not grow).")
    d_model: int | None = option(None, "Hidden width.")
    n_heads: int | None = option(None, "Query heads.")
    n_kv_heads: int | None = option(None, "Key/value heads (GQA when fewer than n_heads).")
    d_ff: int | None = option(None, "SwiGLU inner width.")
    vocab: int | None = option(None, "Vocabulary size.")
    rope_theta: float | None = option(None, "RoPE base frequency.")
    rope_scaling_factor: float | None = option(
        None, "Llama 3.1 long-context RoPE scaling factor; 0 turns scaling off.")
    tie_embeddings: bool | None = option(None, "Share the input embedding with the unembedding.")
    dtype: Literal["bfloat16", "float32"] = option(
        "bfloat16", "Compute dtype; master weights and optimizer state stay float32.")
    norm_eps: float = option(1e-5, "RMSNorm epsilon.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class DataConfig:
    seq_len: int = option(256, "Tokens per sequence.")
    batch_size: int = option(8, "Global batch size in sequences (all devices together).")
    source: str = option(
        "synthetic",
        "'synthetic' (a copy task across the whole sequence), a token file (.bin/.npy), "
        "or a text file or folder of .txt files (byte-level tokenizer).")
    token_dtype: Literal["uint16", "uint32"] = option(
        "uint16", "Element type of a raw .bin token file (.npy files carry their own).")
    eos_id: int | None = option(
        None, "Token that ends a document in a token file; None means one endless document. "
              "Text files use the byte tokenizer's own end-of-document id (256).")


@dataclass
class TrainConfig:
    steps: int = option(300, "Optimizer steps in total (a resumed run continues to this count).")
    lr: float = option(3e-3, "Peak learning rate of AdamW.")
    warmup_steps: int = option(20, "Linear warmup steps, then cosine decay to lr * min_lr_ratio.")
    min_lr_ratio: float = option(0.1, "Final learning rate as a fraction of lr.")
    weight_decay: float = option(0.1, "AdamW weight decay.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value; 0 turns it off.")
    grad_accum_steps: int = option(1, "Micro-batches per optimizer step (batch_size is split).")
    z_loss: float = option(0.0, "Weight of the z-loss (log-partition squared) term.")
    seed: int = option(0, "Seed for parameters and synthetic data.")
    on_nonfinite: Literal["stop", "skip"] = option(
        "stop", "A non-finite loss or gradient: stop before anything is saved (naming the "
                "step), or skip that step's update and go on.")


@dataclass
class MeshConfig:
    data: int = option(-1, "Data-parallel degree; -1 fills the devices the other axes leave.")
    fsdp: int = option(1, "Fully-sharded data-parallel degree (parameters sharded over it).")
    context: int = option(1, "Context-parallel degree: the sequence is split over this axis.")
    tensor: int = option(1, "Tensor-parallel degree (heads and MLP width split over it).")

    def axis_sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context,
                "tensor": self.tensor}


@dataclass
class ParallelConfig:
    strategy: Literal["none", "all_gather", "ulysses", "ring", "usp", "auto"] = option(
        "none", "Context-parallel strategy; 'none' needs mesh.context == 1.")
    load_balance: bool = option(
        True, "Reorder the sequence once on input so causal work is even across context ranks.")
    ulysses: int = option(1, "usp only: Ulysses degree inside mesh.context (ring gets the rest).")


@dataclass
class AttentionConfig:
    impl: Literal["xla", "pallas", "splash", "auto"] = option(
        "xla", "Attention kernel: blockwise XLA reference, our Pallas kernel (Mosaic on TPU, "
               "interpreted on CPU), jax's splash kernel (TPU; needs every chunk of the "
               "stored sequence to be a multiple of 128 tokens), or auto (on TPU splash for "
               "every kernel call its tiles fit, else pallas; xla elsewhere).")
    block_q: int = option(512, "Query block size of the blockwise kernels.")
    block_kv: int = option(512, "Key/value block size of the blockwise kernels.")


@dataclass
class RematConfig:
    policy: Literal["full", "minimal", "save_all", "custom"] = option(
        "full", "What each layer keeps for backward besides its input (the layer scan always "
                "saves that; custom can offload it as decoder_layer_input): nothing (full), "
                "matmul outputs (minimal), everything (save_all), or per tensor (custom).")
    tensors: dict[str, Literal["remat", "device", "offload"]] = option(
        {}, "custom only: tensor name -> remat | device | offload (to pinned host memory). "
            "Names: " + ", ".join(REMAT_TENSORS) + ".")
    mlp_chunk_tokens: int = option(
        0, "Tokens per chunk (whole sequence, all devices together) of every layer's MLP: "
           "its [tokens, d_ff] intermediates then exist one chunk at a time and are "
           "recomputed in backward (so mlpwi/mlpwo are never saved); 0 runs the MLP on the "
           "whole sequence at once.")


@dataclass
class OptimizerConfig:
    offload: bool = option(
        False, "Keep the AdamW moments (float32, 8 bytes per parameter) in pinned host memory; "
               "each step moves them to the device for the update and back. On CPU both memories "
               "are RAM: it runs, and saves nothing.")


@dataclass
class LossConfig:
    chunk_tokens: int | None = option(
        None, "Tokens per chunk of the cross-entropy: the logits exist one chunk at a time "
              "(forward and backward); 0 computes them whole; null picks from data.seq_len.")


@dataclass
class CheckpointConfig:
    every: int = option(100, "Save every N steps (and always at the end); 0 saves only at the end.")
    keep: int = option(3, "Checkpoints kept on disk; older ones are deleted.")


@dataclass
class RuntimeConfig:
    cpu_devices: int = option(
        0, "Fake CPU devices to create (testing without accelerators); 0 leaves jax's default.")
    log_every: int = option(10, "Print and record metrics every N steps.")


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
