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
count, fitted on compiled programs: calibration.json beside this module, which
`python benchmarks/refit_planner.py --fit` writes with what each term counts, the
toolchain and grid of the fit and the estimate's accuracy (accuracy.py's notes quote it;
benchmarks/RESULTS.md, "Planner accuracy, round by round", has the refits' history). The
traffic figures are formulas of the code, checked exactly.
"""

from __future__ import annotations

import dataclasses

from lctrain import kernels
from lctrain.kernels import splash
from lctrain.parallel import STRATEGIES
from lctrain.parallel.cost_model import F32, AttentionFootprint, Dims
from lctrain.parallel.planner.calibration import fitted_copies
from lctrain.parallel.planner.layer_kinds import KindsCostModel
from lctrain.parallel.planner.shapes import (Weights, checkpoint_shares, loss_chunks,
                                             mlp_chunk_len)
from lctrain.parallel.ring_cost import ring_attention_footprint
from lctrain.parallel.strategy import ContextStrategy, stored_chunk_tokens
from lctrain.recipes.schema import Recipe

# A TPU lays an array's last dimension out in tiles of this many lanes.
TPU_LANES = 128

# How many copies of each term are alive at the peak (calibration.json says what each
# counts and where its value comes from). A dict the refit updates in place.
CALIBRATION = fitted_copies()

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


def lane_padded(dm: Dims, impl: str) -> Dims:
    """dm with its head_dim as the Pallas kernels' tensors take it in HBM: their native
    layout ([heads, tokens, head_dim]) puts head_dim last, and a TPU lays the last dimension
    out in tiles of TPU_LANES, so heads of 64 take the bytes of heads of 128."""
    if impl not in ("pallas", "splash"):
        return dm
    return dataclasses.replace(dm, d=-(-dm.d // TPU_LANES) * TPU_LANES)


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
    heads_dm = lane_padded(dm, impl)
    footprint = strategy.attention_footprint(heads_dm)
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
        "attention": _attention_working_set(strategy, heads_dm),
        **_kernel_scratch(dm, footprint, impl, recipe),
    }
    if recipe.remat.policy == "save_all":
        terms["activations"] += L * strategy.kernel_residuals(heads_dm)
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
    the exchange goes (the compiled programs hold no copy of it beside the ring's, as
    usp's footprint counts it: calibration.json's ring_attention_copies). With layer
    kinds, the largest kind's: one layer's backward runs at a time."""
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
    (kernels.native_layout; the refit finds no head-major relayout beside the layer's
    tensors)."""
    b = dm.b
    sq, skv, heads = call.q_tokens, call.kv_tokens, call.heads
    terms: dict[str, float] = {}
    if impl == "splash":
        # splash writes its logsumexp TPU_LANES wide ([heads, sq, TPU_LANES] f32) before keeping
        # lane 0
        terms["kernel_scratch"] = b * heads * sq * TPU_LANES * F32
    if impl == "xla":
        block_q, block_kv = min(recipe.attention.block_q, sq), min(recipe.attention.block_kv, skv)
        terms["kernel_scratch"] = (CALIBRATION["kernel_block_scores"]
                                   * b * heads * block_q * block_kv * F32)
    return terms
