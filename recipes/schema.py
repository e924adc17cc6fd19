"""The recipe schema: every option lctrain understands, its type, default and meaning.

This module must not import jax: the CLI reads the recipe (for example
`runtime.cpu_devices`) before jax initialises its backends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# The model section lives in model_schema.py; these names stay importable from here.
from .model_schema import (LAYER_KINDS, LLAMA31_ROPE_SCALING, MODEL_PRESETS,  # noqa: F401
                           ROPE_KEYS, ROPE_SCALING_KEYS, LayerGroupConfig, ModelConfig,
                           RopeScalingConfig, read_rope_scaling_keys)
from .options import RecipeError, option, require  # noqa: F401

REMAT_TENSORS = (
    "decoder_layer_input", "query_proj", "key_proj", "value_proj",
    "context", "out_proj", "mlpwi", "mlpwo",
)

# eval.task's RULER tasks (trainer/evaluation/ruler_tasks.py builds them; it asserts that
# they agree) and the group that runs them all.
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
               "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
               "vt", "cwe", "fwe", "qa_1", "qa_2")
# RULER's QA tasks: the eval key naming the local file each is built from, and that file.
QA_FILES = {"qa_1": ("squad", "SQuAD v2's dev json (dev-v2.0.json)"),
            "qa_2": ("hotpotqa", "HotpotQA's dev distractor json (hotpot_dev_distractor_v1.json)")}

# The names a recipe may give parallel.strategy: the classes parallel/__init__.py registers
# under these names (it asserts that they agree: that registry needs jax, which this module
# must not import), and auto.
STRATEGY_NAMES = ("none", "all_gather", "ulysses", "ring", "usp", "halo", "state_passing", "auto")
# Strategies that run one layer kind only (halo's attend refuses window=None; state_passing
# runs the delta rule, not attention): never a whole model's strategy.
KIND_ONLY_STRATEGIES = {"halo": "sliding", "state_passing": "linear"}
# The strategies linear (Gated DeltaNet) layers take (none: mesh.context 1).
LINEAR_STRATEGIES = ("none", "state_passing", "auto")


@dataclass(frozen=True)
class SourceConfig:
    """One component of a data mixture (data.sources)."""
    path: str = option(
        "", "A token file (.bin/.npy with its sidecar <file>.json) or a text file / folder "
            "of .txt files, as data.source takes (a relative path is taken from the working "
            "directory).")
    weight: float = option(
        1.0, "Share of training TOKENS drawn from this source (every row is seq_len tokens "
             "of one source); weights are normalized by their sum.")
    min_doc_tokens: int = option(
        0, "Keep only documents of at least this many tokens (eos included); 0 keeps all.")
    max_doc_tokens: int | None = option(
        None, "Keep only documents of at most this many tokens (eos included); null: no "
              "upper bound.")
    start_at_document: bool = option(
        False, "Read only windows that begin at a document start (the rest of the window "
               "packs the documents that follow), instead of every seq_len-token window.")


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = option(256, "Tokens per sequence.")
    batch_size: int = option(8, "Global batch size in sequences (all devices together).")
    source: str = option(
        "synthetic",
        "'synthetic' (a copy task across the whole sequence), a token file (.bin/.npy, "
        "e.g. from `lctrain tokenize`), or a text file or folder of .txt files (each file "
        "one document, tokenized with data.tokenizer, else byte by byte). A relative path is "
        "taken from the working directory, not the recipe's folder.")
    tokenizer: str | None = option(
        None, "Text sources: a Hugging Face model folder (tokenizer.json, tokenizer_config.json) "
              "or a tokenizer.json file; documents end with its config's eos_token. null: "
              "the byte-level tokenizer (ids 0-255, end of document 256).")
    token_dtype: Literal["uint16", "uint32"] | None = option(
        None, "Element type of a raw .bin token file; null takes its sidecar's (<file>.json), "
              "else uint16. A value that disagrees with the sidecar is an error; .npy files "
              "carry their own.")
    eos_id: int | None = option(
        None, "Token that ends a document in a token file; null takes its sidecar's "
              "(<file>.json). A raw token file with neither is one endless document. Text "
              "sources use their tokenizer's end of document.")
    sources: list[SourceConfig] = option(
        [], "A mixture in place of data.source: a list of {path, weight, min_doc_tokens, "
            "max_doc_tokens, start_at_document}, keys below; each row of a batch comes from "
            "one source, drawn with probability weight / sum of weights. Leave data.source "
            "unset with it. The sources must share one tokenizer.")
    other_tokenizer: bool = option(
        False, "With model.init=hf:<dir>: the data's tokenizer (its sidecar's, or "
               "data.tokenizer) may differ from the folder's tokenizer.json, as when the "
               "vocabulary is changed on purpose. false refuses such data: the same ids would "
               "mean other text to the model, and the export would ship the data's tokenizer.")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(300, "Optimizer steps in total (a resumed run continues to this count).")
    lr: float = option(3e-3, "Peak learning rate of AdamW.")
    warmup_steps: int = option(
        20, "Linear warmup steps, then cosine decay to lr * min_lr_ratio; a run shorter than "
            "this warms up over steps - 1 (and says so).")
    min_lr_ratio: float = option(0.1, "Final learning rate as a fraction of lr.")
    weight_decay: float = option(0.1, "AdamW weight decay.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value; 0 turns it off.")
    grad_accum_steps: int = option(1, "Micro-batches per optimizer step (batch_size is split).")
    z_loss: float = option(0.0, "Weight of the z-loss (log-partition squared) term.")
    seed: int = option(0, "Seed for parameters and synthetic data.")
    on_nonfinite: Literal["stop", "skip"] = option(
        "stop", "A non-finite loss or gradient: stop before anything is saved (naming the "
                "step), or skip that step's update and go on.")


    @property
    def run_warmup_steps(self) -> int:
        """The warmup this run gets: warmup_steps, clamped so a short try run still ends
        at the peak learning rate."""
        return min(self.warmup_steps, self.steps - 1)


@dataclass(frozen=True)
class MeshConfig:
    data: int = option(-1, "Data-parallel degree; -1 fills the devices the other axes leave.")
    fsdp: int = option(1, "Fully-sharded data-parallel degree (parameters sharded over it).")
    context: int = option(1, "Context-parallel degree: the sequence is split over this axis.")
    tensor: int = option(1, "Tensor-parallel degree (heads and MLP width split over it).")
    dcn_data: int = option(
        1, "Multi-slice TPU: slices the data axis spans (they talk over the data-center "
           "network, DCN); mesh.data stays the total degree, so this must divide it. "
           "mesh.dcn_data x mesh.dcn_fsdp = the number of slices; context and tensor "
           "stay inside one slice.")
    dcn_fsdp: int = option(
        1, "Multi-slice TPU: slices the fsdp axis spans; must divide mesh.fsdp (the total "
           "degree).")

    def axis_sizes(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "context": self.context,
                "tensor": self.tensor}

    def dcn_sizes(self) -> dict[str, int]:
        """Slices each mesh axis spans (parallel/mesh.build_mesh's `dcn`)."""
        return {"data": self.dcn_data, "fsdp": self.dcn_fsdp}

    @property
    def slices(self) -> int:
        return self.dcn_data * self.dcn_fsdp


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal[STRATEGY_NAMES] | dict[str, Literal[STRATEGY_NAMES]] = option(
        "none", "Context-parallel strategy; 'none' needs mesh.context == 1, the others but "
                "auto mesh.context >= 2. With model.layer_pattern, a strategy for every "
                "layer kind, e.g. {global: ring, sliding: halo} (halo runs sliding layers "
                "only; linear layers run on state_passing, or none, and nothing else on "
                "them; auto, whole or for some kinds, plans each kind); one name serves all.")
    load_balance: bool = option(
        True, "Reorder the sequence once on input so causal work is even across context ranks.")
    ulysses: int = option(1, "usp only: Ulysses degree inside mesh.context (ring gets the rest).")

    def by_kind(self, kinds) -> dict[str, str]:
        """The strategy name of each of the layer `kinds` (one name serves them all)."""
        if isinstance(self.strategy, dict):
            return {kind: self.strategy[kind] for kind in kinds if kind in self.strategy}
        return {kind: self.strategy for kind in kinds}

    def keyed_names(self) -> list[tuple[str, str]]:
        """(recipe key, strategy name) of every strategy the recipe names."""
        if isinstance(self.strategy, dict):
            return [(f"parallel.strategy.{kind}", name) for kind, name in self.strategy.items()]
        return [("parallel.strategy", self.strategy)]


@dataclass(frozen=True)
class AttentionConfig:
    impl: Literal["xla", "pallas", "splash", "triton", "auto"] = option(
        "auto", "Attention kernel: auto (on TPU splash for every kernel call its tiles fit, "
                "else pallas; xla elsewhere), blockwise XLA reference (computes every block "
                "pair: twice the causal FLOPs), our Pallas kernel (Mosaic on TPU, interpreted "
                "and slow on CPU), jax's splash kernel (TPU; needs every chunk of the "
                "stored sequence to be a multiple of 128 tokens), or our GPU kernel (Pallas "
                "through Triton on NVIDIA GPUs, skipping masked blocks; interpreted on CPU; "
                "not yet timed on a GPU, so auto does not pick it).")
    block_q: int | None = option(
        None, "Query block size of the blockwise kernels; null: the fastest measured on "
              "the chip for the tokens per chip (kernels/tiles.py), else 512.")
    block_kv: int | None = option(
        None, "Key/value block size of the blockwise kernels; null as for block_q.")


@dataclass(frozen=True)
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
    layers_per_checkpoint: int = option(
        1, "Layers between saved layer inputs: the layer scan keeps (or offloads) the input of "
           "one layer in this many and recomputes the others' from it in backward, which "
           "costs one more forward of those layers. 1 saves every layer's input. Needs "
           "remat (not save_all) and a model of global layers only.")
    recast_weights: bool = option(
        False, "Cast each layer's float32 weights to the compute dtype inside the layer loop, "
               "each time forward or backward uses them, not once per step: XLA's TPU compiler "
               "otherwise holds a compute-dtype copy of every layer's weights through the step "
               "(2 bytes per parameter over the weights' sharding). Costs the casts, a "
               "share of the step that falls as sequences grow (benchmarks/RESULTS.md). TPU "
               "only (elsewhere it changes nothing).")
    compiler_remat_percent: int | None = option(
        None, "Percent of the chip's HBM above which XLA's TPU compiler rematerializes "
              "(recomputes) tensors of its own choosing, on top of the policy (its "
              "xla_jf_rematerialization_percent_shared_memory_limit); null keeps libtpu's "
              "default. Not monotonic in the percent (benchmarks/RESULTS.md): check with "
              "`lctrain plan --compile`. Costs the recomputation where it acts. "
              "TPU only (elsewhere it changes nothing).")


@dataclass(frozen=True)
class OptimizerConfig:
    offload: bool = option(
        False, "Keep the AdamW moments (float32, 8 bytes per parameter) in pinned host memory; "
               "each step moves them to the device for the update and back. On CPU both memories "
               "are RAM: it runs, and saves nothing.")


@dataclass(frozen=True)
class LossConfig:
    chunk_tokens: int | None = option(
        None, "Tokens per chunk of the cross-entropy: the logits exist one chunk at a time "
              "(forward and backward); 0 computes them whole; null picks from data.seq_len.")


@dataclass(frozen=True)
class EvalConfig:
    source: str | None = option(
        None, "Data `lctrain eval` reads (any data.source kind; a relative path is taken from "
              "the working directory); null takes data.source.")
    batches: int = option(4, "Batches of data.batch_size sequences `lctrain eval` averages over.")
    seq_len: int | None = option(
        None, "Tokens per evaluated sequence; null takes data.seq_len. It may exceed the "
              "training length (the mesh must split it as it splits data.seq_len).")
    task: Literal[("loss", "needle", "passkey", "ruler") + RULER_TASKS] = option(
        "loss", "What `lctrain eval` measures besides loss by position: needle (a key-value "
                "sentence) or passkey (digits) retrieval over a grid of haystack lengths and "
                "needle depths; ruler (RULER's tasks: the niah_*, vt, cwe, fwe, and qa_1 / "
                "qa_2 when eval.squad / eval.hotpotqa is given) or one RULER task by name, by "
                "length. All scored teacher-forced.")
    lengths: int = option(6, "needle/passkey: haystack lengths, log-spaced up to eval.seq_len; "
                             "RULER: lengths halving from eval.seq_len.")
    depths: int = option(11, "needle/passkey: needle depths, evenly from 0 (start) to 1 (end).")
    samples: str | None = option(
        None, "A .jsonl of samples made by RULER's or lm-eval's generators (fields input, "
              "outputs, length; lm-eval's max_length and gen_prefix when there) to score "
              "with RULER's scoring instead of lctrain's own samples.")
    squad: str | None = option(
        None, "RULER's qa_1: a local SQuAD v2 dev json (dev-v2.0.json) whose questions and "
              "paragraphs it is built from; without it the ruler group skips qa_1.")
    hotpotqa: str | None = option(
        None, "RULER's qa_2: a local HotpotQA dev distractor json "
              "(hotpot_dev_distractor_v1.json); without it the ruler group skips qa_2.")
    threshold: float = option(
        85.6, "RULER: the score (%) whose longest length kept at every shorter length too "
              "is the effective context length (RULER's paper: 85.6, Llama-2-7B at 4K).")
    every: int = option(
        0, "Evaluate every N steps during training, on held-out data (eval.source, or the "
           "eval.holdout share of data.source; synthetic data draws unseen sequences); 0 never.")
    holdout: float = option(
        0.0, "Share of data.source's windows kept out of training for evaluation: windows 0, "
             "k, 2k, ... with k = round(1 / holdout). 0 holds none out (then evaluation reads "
             "data.source in another order). Ignored when eval.source is set.")

    @property
    def data_holdout(self) -> float:
        """The share of data.source held out: none when evaluation reads its own source."""
        return self.holdout if self.source is None else 0.0


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = option(100, "Save every N steps (and always at the end); 0 saves only at the end.")
    keep: int = option(3, "Checkpoints kept on disk; older ones are deleted.")


@dataclass(frozen=True)
class RuntimeConfig:
    cpu_devices: int | Literal["auto"] = option(
        0, "Fake CPU devices to create (testing without accelerators); 0 leaves jax's default; "
           "auto: 8 when jax would find no accelerator (no TPU or GPU device node with its jax "
           "plugin installed, or JAX_PLATFORMS=cpu), else none.")
    log_every: int = option(10, "Print and record metrics every N steps.")


@dataclass(frozen=True)
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        """Every key, as recipe YAML; an imported model's (unused) preset is left out, so
        the dict loads back as the same recipe."""
        raw = dataclasses.asdict(self)
        if self.model.hf_dir is not None:
            del raw["model"]["preset"]
        # Only the data key in use: both is an error, and without a mixture recipe.yaml
        # stays what it was before data.sources existed (resume compares it).
        del raw["data"]["source" if self.data.sources else "sources"]
        # Keys the type does not read would be refused on loading it back.
        raw["model"]["rope_scaling"] = read_rope_scaling_keys(raw["model"]["rope_scaling"])
        return raw

    def with_strategy(self, strategy: str | dict[str, str], ulysses: int) -> "Recipe":
        """A copy naming `strategy` (a name, or a map kind -> name) with Ulysses degree
        `ulysses`: a candidate of auto, a plan's strategy, the strategy a run compiled."""
        return dataclasses.replace(self, parallel=dataclasses.replace(
            self.parallel, strategy=strategy, ulysses=ulysses))

    def for_evaluation(self) -> "Recipe":
        """The recipe as evaluation reads data: eval.source and eval.seq_len in place of
        data's."""
        data = dataclasses.replace(self.data, source=self.eval.source or self.data.source,
                                   sources=[] if self.eval.source else self.data.sources,
                                   seq_len=self.eval.seq_len or self.data.seq_len)
        return dataclasses.replace(self, data=data)
