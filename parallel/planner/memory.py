"""What one device holds in HBM (and pinned host memory) at the step's peak.

Memory: a program's peak is what is alive together; per device
  whole step       state (f32 parameters + AdamW mu, nu, 12 bytes / sharded parameter),
                   batch, the compute-dtype copies of the stacked layer weights (XLA
                   hoists the casts out of the layer loop), the gathered embedding and
                   output tables, the saved activations (remat policy x layers; every
                   policy keeps the layer input, the scan carry, unless it is offloaded);
  plus the largest of three phases:
  loss             the output weights gathered and their full f32 gradient, one chunk's
                   f32 logits, the hidden states cut into chunks and their gradient;
  layer MLP        f32 gradients (sharded), one layer's gathered weights and full
                   gradient, its [tokens, d_model] tensors, the MLP's recomputed
                   [tokens, d_ff] intermediates (one chunk with remat.mlp_chunk_tokens),
                   and a checkpointed group's recomputed layer inputs;
  layer attention  the same layer-wide terms with, instead of the MLP's, the strategy's
                   attention working set (gathered K/V and their f32 gradients; head-
                   sharded q, k, v, out; rotating K/V, f32 dK/dV and out/dq
                   accumulators), the xla kernel's block scores or splash's wide
                   logsumexp.
  host             tensors a `custom` remat policy offloads, per layer, and the AdamW
                   moments with optimizer.offload (8 bytes / sharded parameter; the step
                   copies them in at its start, so they count on the device at the peak
                   too), in pinned host memory.
The strategy's attention working set and what its kernel keeps under save_all come from
the strategy's own cost model (parallel/cost_model.py); the rest is common to all.

Calibration. XLA's temporary allocation is not the sum of what the code creates: it fuses
intermediates away, keeps extra copies (relayouts, stacked residuals), and its buffer
assignment is larger than the live peak. CALIBRATION holds how many copies of each term
count. They were first fitted on small models on v5p:2x2x1 (tests/test_planner.py's grid,
where the traffic figures match XLA's collective bytes within 3.5%), and are now refitted
(`python benchmarks/refit_planner.py --fit`) on the "fit" grid of
benchmarks/data/planner_grid.jsonl: llama3.1-8b compiled for v5p:2x2x1 (128K, 512K tokens;
1M with the layer inputs offloaded and the MLP in chunks, recipes/llama3_8b_1m.yaml) and
v5p:4x4x4 (1M, 4M), all_gather, ulysses, ring, usp x full and offloaded remat. There the
estimate is within 11.2% of XLA's per-chip HBM (rms 5.0%, 32 points); on the held-out grid
(256K, 1M on 4 chips, 512K and 2M with MLP chunks, 128K with recipes/llama3_8b_128k.yaml's
settings, and in groups of two layers at 128K and 2M; 2M, 8M on 64) within 14.7% but for
ulysses at 2M on 4 chips, 18.2% under (rms 6.9%, 41 points); on the small models' grid
within 14.0% (rms 8.7%, 24 points). Every point was compiled again after the loss and MLP
scheduling fixes of 2026-12-04 (trainer/model/loss.py,
trainer/model/transformer.gradients_together), which moved the figures by up to 37% (ring
on 64 chips, offloaded); before them the estimate was within 14.0% / 24.5%, with usp (Ulysses
degree above the KV heads) and all_gather at 8M on 64 chips outside 15%. The ring's and
usp's points were compiled again on 2026-12-05 after the ring backward's new order
(parallel/ring.py: the 1M recipe 83.71 -> 76.19 GB, so its estimate is now 11.2% high;
only programs with MLP chunks moved); CALIBRATION was fitted before that. Where the grid stops (more chips, other models),
accuracy.py says so in the plan. The traffic figures are formulas of the code, checked
exactly.
"""

from __future__ import annotations

import dataclasses

from lctrain import kernels
from lctrain.kernels import splash
from lctrain.parallel import STRATEGIES
from lctrain.parallel.cost_model import F32, AttentionFootprint, Dims
from lctrain.parallel.planner.layer_kinds import KindsCostModel
from lctrain.parallel.planner.shapes import (Weights, checkpoint_shares, loss_chunks,
                                             mlp_chunk_len)
from lctrain.parallel.ring_cost import ring_attention_footprint
from lctrain.parallel.strategy import ContextStrategy, stored_chunk_tokens
from lctrain.recipes.schema import Recipe

SPLASH_LSE_LANES = 128

# How many copies of a tensor are alive at the peak, fitted on compiled programs (the fit
# grid of benchmarks/data/planner_grid.jsonl) where the code alone does not decide it. The
# buffers named below are from the buffer assignment XLA dumps (--xla_dump_to) for
# llama3.1-8b at 1M-2M tokens on v5p:4x4x4.
CALIBRATION = {
    # f32 [b, heads, block_q, block_kv] scores, probabilities, dp, ds of one block pair in
    # the xla kernel's loops.
    "kernel_block_scores": 6.031,
    # The strategy's attention working set in one layer's backward (as the code writes
    # it: gathered / all-to-all'd / rotating tensors and their gradients), per copy: XLA
    # reuses buffers between the forward and backward halves.
    "attention_copies": 0.94,
    # The same for a ring's rotating blocks and accumulators (usp's too). Only programs
    # with the MLP in chunks (remat.mlp_chunk_tokens) peak there: fitted on
    # recipes/llama3_8b_1m.yaml's ring and usp (the small models' value was 0.35).
    "ring_attention_copies": 1.193,
    # One layer's backward MLP intermediates, in units of 5 [b, tokens, d_ff] (gate, up,
    # silu(gate) * up and two gradients; tokens: one chunk with remat.mlp_chunk_tokens):
    # 1.605 on the programs before trainer/model/transformer.gradients_together (their 64-chip ring
    # program placed bf16 [16384, 14336] buffers at 8-9 offsets), 0.985 since.
    "layer_backward": 0.985,
    # [b, s_l, d_model] compute-dtype tensors alive in one layer's backward (inputs,
    # residuals, norms, projections and their gradients). Without MLP chunks this is a
    # fixed share of the MLP's term at one model width; the grid's MLP-chunk points (one
    # chunk's [tokens, d_ff] intermediates) part the two.
    "layer_width_tensors": 4.927,
    # Saved named tensors (minimal, custom) per copy the policy implies: XLA keeps the
    # scan's stacked residuals and a relayout of some of them.
    "saved_copies": 1.273,
    # The scan's stacked layer inputs (the carry every policy keeps unless it is
    # offloaded): the buffer assignment holds one bf16 [32, 1, s_l, 4096] stack, yet a
    # full-remat program's HBM exceeds its offloaded twin's by 1.3-2.0 stacks on 4 chips
    # and 1.25-2.25 for ring and usp on 64 (all_gather on 64 chips: 0.7-1.7). Fitted: the
    # compiled figure (memory_analysis) exceeds the buffer assignment's own total by more
    # with the stack on the device (usp, 1M tokens on v5p:4x4x4: by 5.5 GB against 2.0
    # GB offloaded), so the extra copies are not tensors the dump names.
    "stacked_input_copies": 1.711,
    # Compute-dtype copies of the stacked layer weights: the hoisted casts (one). With the
    # f32 gradients below it scales as 1 / ZeRO group on the 8B grid, so the two trade.
    "weight_copies": 2.047,
    # The copies remat.recast_weights removes (the hoisted casts: XLA then casts each
    # layer's weights inside the loop): 0.76-0.85 of one (2.65-2.95 GB) for the four
    # strategies of recipes/llama3_8b_128k.yaml on v5p:2x2x1, compiled with and without.
    "recast_weight_copies": 0.79,
    # A checkpointed group's backward (remat.layers_per_checkpoint = k > 1) recomputes the
    # inputs of its other k - 1 layers and holds them with their gradients: copies of one
    # [b, s_l, d_model] compute-dtype tensor per recomputed input. llama3.1-8b, 512K tokens
    # per chip, compiled in groups of 2 and of 1: +21.6 GB (5.0 inputs) on v5p:4x4x4 and
    # +8.1 GB on v5p:2x2x4 (ring), but none on v5p:2x2x1, where the peak sits elsewhere;
    # 1.8 keeps every compiled point within 15% (benchmarks/RESULTS.md, 2026-12-07).
    "group_input_copies": 1.8,
    # f32 gradient buffers in the layers' backward.
    "gradient_copies": 1.224,
    # Copies of the gathered output weights (compute dtype) in the loss backward.
    "head_weight_copies": 0.394,
    # The gathered embedding and output tables (compute dtype), kept through the whole
    # step, in units of one table: 1.587 on the programs before the loss and MLP scheduling
    # fixes of 2026-12-04 (the 64-chip ones placed bf16 [4096, 128256] at four offsets);
    # the refit on the programs since finds none beside the other terms.
    "gathered_table_copies": 0.0,
    # One chunk's f32 logits: the logits and their softmax / gradient.
    "logits_copies": 1.404,
}

# The terms of each phase; the peak holds the largest phase and every term of no phase.
# One layer's backward runs its MLP and its attention one after the other, so their
# working sets peak apart, each beside what the whole layer holds.
_LAYER = ("gradients", "embedding_gradient", "layer_weights", "layer_width", "group_inputs")
PHASES = {"loss": ("loss_head", "loss_logits"),
          "layer_mlp": (*_LAYER, "layer_mlp"),
          "layer_attention": (*_LAYER, "attention", "kernel_scratch")}


@dataclasses.dataclass(frozen=True)
class Memory:
    terms: dict[str, float]          # HBM bytes per device by term
    host: dict[str, float]           # pinned host bytes per device by term
    peak_phase: str
    peak_terms: tuple[str, ...]      # the terms alive together at the peak


def kernel_impl(recipe: Recipe, platform: str, axis_sizes: dict[str, int]) -> str:
    """The attention kernel the run uses on `platform` (as kernels.attention resolves it
    for the strategy's kernel calls)."""
    if platform == "gpu":
        return "xla"  # the TPU kernels fall back to xla.py's there
    chunk = stored_chunk_tokens(recipe, axis_sizes["context"])
    lengths = STRATEGIES[recipe.parallel.strategy].kernel_lengths(recipe, axis_sizes)
    blocks = recipe.attention.block_q, recipe.attention.block_kv
    impl = kernels.impl_for_call(recipe.attention.impl, platform, *lengths, *blocks, chunk)
    if impl == "splash" and not splash.supports(*lengths, *blocks, chunk):
        return "pallas"  # an explicit splash the recipe check refuses: estimate the fallback
    return impl


def memory(recipe: Recipe, dm: Dims, w: Weights, strategy: type[ContextStrategy],
           impl: str) -> Memory:
    """Live for the whole step: the state, the batch, the compute-dtype weight stacks, what
    the remat policy saves. On top of them, the larger of two phases: the loss (its
    backward starts the backward pass) and one layer's backward."""
    L, p, b = dm.layers, dm.p, dm.b
    n_chunks, chunk_tokens = loss_chunks(recipe, dm.c)
    tokens = b * dm.s_l                               # per device per micro-batch
    mlp_tokens = b * mlp_chunk_len(recipe, dm.c)      # the MLP's [tokens, d_ff] at a time
    saved_token, host_token = _saved_per_token(recipe, dm)
    embedding_table_grad = (w.embedding * F32 * 2 * (dm.g - 1) / dm.g
                            <= dm.step_tokens * dm.e * F32)
    footprint = strategy.attention_footprint(dm)
    weight_copies = CALIBRATION["weight_copies"] - (
        CALIBRATION["recast_weight_copies"] if recipe.remat.recast_weights else 0.0)
    terms: dict[str, float] = {
        "state": 12 * w.local,
        "batch": 5 * 4 * dm.rows * dm.s_l,
        "weight_copies": weight_copies * p * w.layer_local * L if p < F32 else 0,
        "activations": L * tokens * saved_token,
        "gathered_tables": CALIBRATION["gathered_table_copies"] * p * w.head,
        # loss phase: the output weights gathered (compute dtype) and their full f32
        # gradient, one chunk's f32 logits (and softmax / gradient), the hidden states
        # cut into chunks and their gradient
        "loss_head": w.head * (F32 + CALIBRATION["head_weight_copies"] * p),
        "loss_logits": (CALIBRATION["logits_copies"] * b * chunk_tokens * dm.v * F32
                        + (2 * tokens * dm.e * p if n_chunks > 1 else 0)),
        # layer phase: f32 gradients (sharded), one layer's weights gathered (and the next
        # one's, prefetched) and its full gradient in the compute dtype, the layer's
        # recomputed intermediates, the attention's working set
        "gradients": CALIBRATION["gradient_copies"] * F32 * w.local,
        # the embedding's full f32 gradient, where XLA all-reduces the table (see traffic)
        "embedding_gradient": F32 * w.embedding if embedding_table_grad else 0.0,
        "layer_weights": 3 * p * w.layer_gathered + 2 * F32 * w.mlp_gathered,
        "layer_width": CALIBRATION["layer_width_tensors"] * tokens * dm.e * p,
        # a checkpointed group's backward holds the inputs it recomputed: all but its
        # first layer's (the recipe check keeps remat.layers_per_checkpoint <= layers)
        "group_inputs": (CALIBRATION["group_input_copies"] * tokens * dm.e * p
                         * (recipe.remat.layers_per_checkpoint - 1)),
        "layer_mlp": CALIBRATION["layer_backward"] * mlp_tokens * 5 * dm.f * p,
        "attention": _attention_working_set(strategy, dm),
        **_kernel_scratch(dm, footprint, impl, recipe),
    }
    if recipe.remat.policy == "save_all":
        terms["activations"] += L * strategy.kernel_residuals(dm)
    host = {"offloaded_activations": L * tokens * host_token} if host_token else {}
    if getattr(getattr(recipe, "optimizer", None), "offload", False):
        # optimizer.offload keeps AdamW's moments in pinned host memory between steps;
        # the step copies them in at its start (XLA schedules it early), so the device
        # still holds them at the peak.
        host["optimizer_moments"] = 8 * w.local
    peak_phase = max(PHASES, key=lambda ph: sum(terms.get(t, 0.0) for t in PHASES[ph]))
    phased = {t for names in PHASES.values() for t in names}
    return Memory(terms, host, peak_phase, tuple(
        t for t in terms if t not in phased or t in PHASES[peak_phase]))


def _attention_working_set(strategy: type[ContextStrategy] | KindsCostModel,
                           dm: Dims) -> float:
    """The strategy's attention working set, calibrated: without a ring (gathered or
    all-to-all'd tensors) attention_copies times; with one, the ring's rotating blocks
    and accumulators ring_attention_copies times, and nothing for usp's all-to-alls around
    it: their local side holds the ring's q, k, v, out, dout in the other layout, freed as
    the exchange goes (a copy of it beside the ring's, as usp's footprint counts it, is
    what the compiled programs do not hold: 1M tokens on v5p:2x2x1 with the MLP in
    chunks compiles to 83.74 GB for usp, 87.04 GB for ring). With layer kinds, the
    largest kind's: one layer's backward runs at a time."""
    if isinstance(strategy, KindsCostModel):
        return max(_attention_working_set(cls, kind_dims)
                   for cls, kind_dims in strategy.kinds.values())
    if dm.r == 1:
        return CALIBRATION["attention_copies"] * strategy.attention_footprint(dm).working_set
    return CALIBRATION["ring_attention_copies"] * ring_attention_footprint(dm).working_set


def _remat_tensors(dm: Dims) -> dict[str, float]:
    """Bytes per token of each named tensor of one layer (trainer/model/transformer.py names)."""
    p = dm.p
    return {
        "decoder_layer_input": dm.e * p,
        "query_proj": dm.h * dm.d * p,
        "key_proj": dm.kv * dm.d * p,
        "value_proj": dm.kv * dm.d * p,
        "context": dm.h * dm.d * p,
        "out_proj": dm.e * p,
        "mlpwi": 2 * dm.f * p,          # gate and up share the name
        "mlpwo": dm.e * p,
    }


def _saved_per_token(recipe: Recipe, dm: Dims) -> tuple[float, float]:
    """(device bytes, host bytes) saved per token per layer for backward."""
    named = _remat_tensors(dm)
    saved, _ = checkpoint_shares(recipe.model.layers, recipe.remat.layers_per_checkpoint)
    carry = CALIBRATION["stacked_input_copies"] * named["decoder_layer_input"] * saved
    policy = recipe.remat.policy
    if policy == "full":
        return carry, 0.0
    if policy == "minimal":
        return (carry + CALIBRATION["saved_copies"]
                * sum(v for n, v in named.items() if n != "decoder_layer_input")), 0.0
    if policy == "save_all":
        # No remat: every intermediate the backward reads stays, including f32 norm and
        # RoPE temporaries (the kernel's residuals: the strategy's kernel_residuals).
        extra = (2 * dm.e * F32                      # the two RMSNorms' f32 inputs
                 + (dm.h + dm.kv) * dm.d * dm.p      # q, k after RoPE
                 + dm.h * F32                        # lse
                 + 2 * dm.f * dm.p)                  # silu(gate), silu(gate) * up
        return sum(named.values()) + extra, 0.0
    device = CALIBRATION["saved_copies"] * sum(
        named[n] for n, where in recipe.remat.tensors.items()
        if where == "device" and n != "decoder_layer_input")
    # Only the saved layer inputs reach the host or stay on the device
    # (checkpoint_shares); the recomputed ones are the layer phase's group_inputs.
    host = sum(named[n] * (saved if n == "decoder_layer_input" else 1)
               for n, where in recipe.remat.tensors.items() if where == "offload")
    # The scan carry (the layer input) is always kept unless it was offloaded.
    if recipe.remat.tensors.get("decoder_layer_input") != "offload":
        device += carry
    return device, host


def _kernel_scratch(dm: Dims, call: AttentionFootprint, impl: str,
                    recipe: Recipe) -> dict[str, float]:
    """The kernel's own memory for the strategy's kernel call: the xla kernel's block
    scores, splash's wide logsumexp. The Pallas kernels (ours and splash) add no copies of
    q, k, v, out, dout: the strategies keep them in the kernel's own layout
    (kernels.native_layout; the 8B grid's refit found 0.0 copies of a head-major relayout
    beside the layer's tensors, where it found 0.047 before the kernels read their own
    layout)."""
    b = dm.b
    sq, skv, heads = call.q_tokens, call.kv_tokens, call.heads
    terms: dict[str, float] = {}
    if impl == "splash":
        # splash writes its logsumexp 128 lanes wide ([heads, sq, 128] f32) before keeping
        # lane 0 (1M tokens on 4 v5p chips, ring: +4.2 GB over our kernel, compiled)
        terms["kernel_scratch"] = b * heads * sq * SPLASH_LSE_LANES * F32
    if impl == "xla":
        block_q, block_kv = min(recipe.attention.block_q, sq), min(recipe.attention.block_kv, skv)
        terms["kernel_scratch"] = (CALIBRATION["kernel_block_scores"]
                                   * b * heads * block_q * block_kv * F32)
    return terms
