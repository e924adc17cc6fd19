"""Per-device memory and communication of each context-parallel strategy, before compiling.

`plan(recipe, chip, axis_sizes)` estimates, for every strategy the recipe's mesh allows,
what one device holds in HBM (and pinned host memory) at the step's peak and what it
receives over the interconnect per step, how long that takes against the step's compute,
and recommends one. Every figure is a formula over the shapes the code creates; the
formulas were derived from `trainer/model.py`, `trainer/loss.py`, `trainer/step.py`,
`parallel/sharding.py` and the strategy files, then checked against what XLA's TPU
compiler does with them (`lctrain plan --compile`, `tests/test_planner.py -m slow`).
Where the compiler does something the code does not say, the term below says so.

Notation (per device): b rows of the batch (batch / (data*fsdp*accum)), c = mesh.context
(ring x ulysses), s_l = seq/c tokens, t = mesh.tensor, Z = fsdp*c (the ZeRO-3 group that
shares one copy of the weights), G = data*fsdp*c (devices whose gradients are summed), p =
bytes of the compute dtype.

Communication, bytes one device RECEIVES per step (the convention of parallel/aot.py):
  ZeRO-3 weights   every layer's matrices are all-gathered in the compute dtype twice
                   per step (forward; backward, where a rematerialised forward reuses
                   them); the norm scales in f32 (2 + 4 gathers per layer).
  gradients        XLA all-reduces each layer's full gradient in the compute dtype over G
                   and keeps its shard (it does not emit a reduce-scatter): 2(G-1)/G x.
  loss head        with the loss chunked (trainer/loss.py) the output weights are
                   gathered in each chunk's forward and again in its recomputation, and
                   their gradient is all-reduced once per chunk in the compute dtype
                   (unchunked: once, f32 but for a head past HEAD_GRADIENT_F32_LIMIT):
                   n_chunks x the head, which at long context outweighs the strategy's
                   own traffic.
  embedding        token ids all-gathered over Z (the looked-up rows are pinned to their
                   tokens' devices, so no reshuffle follows); backward: the f32 rows
                   sent to the width shards, or the f32 table all-reduced, the smaller.
  strategy         all_gather: K, V (+ int32 positions, segment ids) gathered per layer
                   in the forward and in each recomputation of it, dK, dV reduce-scattered
                   once; ulysses: 4 all-to-alls (q, k, v, out) per forward pass, 4 in the
                   backward (dout, dq, dk, dv), KV heads repeated up to the degree; ring:
                   c sends of K, V, positions, segment ids per forward pass, c sends of
                   K, V, f32 dK, dV, positions, segment ids in the backward; usp: the
                   Ulysses traffic over its degree plus the ring over the rest.
  The first forward's position rotations / gathers do not depend on the layer: XLA hoists
  them out of the layer loop (once per step, not per layer).

Time: compute = (6 x parameters + 6 L s h d_head / 2) flops per token (trainer/metrics.py)
plus what remat recomputes, at the chip's bf16 peak; each collective kind at the link
bandwidth (one link for the ring's one-way sends, two for XLA's bidirectional rings). The
weight gathers, gradient reductions and loss-head traffic can overlap the compute; the
strategy's own gathers / all-to-alls cannot (attention waits for them), nor the part of a
ring send that outlasts its step's attention. Step = max(compute, overlappable traffic) +
exposed traffic; the ring adds its memory-bound merges at HBM bandwidth. MFU bound = model
flops / (peak x step).

Memory: a program's peak is what is alive together; per device
  whole step       state (f32 parameters + AdamW mu, nu, 12 bytes / sharded parameter),
                   batch, the compute-dtype copies of the stacked layer weights (XLA
                   hoists the casts out of the layer loop), the saved activations
                   (remat policy x layers; `full` keeps the layer input, the scan carry);
  plus the larger of two phases:
  loss             the output weights gathered and their full f32 gradient, one chunk's
                   f32 logits, the hidden states cut into chunks and their gradient;
  layers           f32 gradients (sharded), one layer's gathered weights and full
                   gradient, the layer's recomputed intermediates (the MLP's
                   [tokens, d_ff] ones for one chunk with remat.mlp_chunk_tokens), the
                   strategy's attention working set (gathered K/V and their f32 gradients; head-
                   sharded q, k, v, out; rotating K/V, f32 dK/dV and out/dq
                   accumulators), the xla kernel's block scores or the pallas kernel's
                   head-major copies of q, k, v, out, dout.
  host             tensors a `custom` remat policy offloads, per layer, and the AdamW
                   moments with optimizer.offload (8 bytes / sharded parameter; the step
                   copies them in at its start, so they count on the device at the peak
                   too), in pinned host memory.

Calibration. XLA's temporary allocation is not the sum of what the code creates: it fuses
intermediates away, keeps extra copies (relayouts, stacked residuals), and its buffer
assignment is larger than the live peak. CALIBRATION holds how many copies of each term
count, fitted on programs compiled for v5p:2x2x1 (mesh.context 4, one sequence): a
2-layer width-512 and a 4-layer width-1024 / vocab-32K model x all_gather, ulysses, ring
x remat full, minimal x 8K, 32K tokens with attention.impl=xla (24), plus usp and the
pallas kernel on four of them. On those 28 programs the estimate is within 13.4% of
XLA's per-chip HBM (rms 5.5%) and within 3.5% of its collective bytes (what is left: with
ulysses and full remat XLA gathers wq, wk, wv once more; dK/dV lowered half as
reduce-scatter, half as all-reduce). Not fitted on, llama3.1-8b on the same 4 chips
(128K-512K tokens, ring and all_gather, with and without offload or loss chunking) lands
0.1-14.4% under XLA. Treat memory figures as +-15% near those shapes and as a guide
beyond them; the traffic figures are formulas of the code, checked exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable

from lctrain import kernels
from lctrain.kernels import splash
from lctrain.parallel import STRATEGIES
from lctrain.parallel.chips import Chip
from lctrain.parallel.strategy import check_kernel_layout, stored_chunk_tokens
from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.token_chunks import chunks_for

BYTES = {"bfloat16": 2, "float32": 4}
F32, INT32 = 4, 4
SPLASH_LSE_LANES = 128
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Strategies from simplest to most involved: a tie in estimated step time goes to the first.
SIMPLICITY = ("none", "all_gather", "ulysses", "usp", "ring")
# A strategy whose estimated step time is within this factor of the fastest counts as a tie
# (smaller than the estimate's own error: it only settles near-equal cases).
TIE = 1.005
# Share of device HBM a plan may use; the rest is left for XLA's own reserve, fragmentation
# and the estimate's error (the accuracy grid's worst case, see tests/test_planner.py).
HBM_HEADROOM = 0.90

# See the loss-head gradient in estimate(): XLA's choice of all-reduce dtype (f32 below,
# the compute dtype above), between the two sizes it was observed at.
HEAD_GRADIENT_F32_LIMIT = 2**30

# See strategy_dkv in _strategy_comm.
DKV_REDUCE_SCATTER_LIMIT = 32 * 2**20

# How many copies of a tensor are alive at the peak, fitted on compiled programs
# (tests/test_planner.py, v5p:2x2x1) where the code alone does not decide it.
CALIBRATION = {
    # f32 [b, heads, block_q, block_kv] scores, probabilities, dp, ds of one block pair in
    # the xla kernel's loops.
    "kernel_block_scores": 1.9,
    # pallas: head-major copies of the kernel's q, k, v, out, dout (the fit finds none
    # beyond what the other terms hold).
    "pallas_layout_copies": 0.0,
    # The strategy's attention working set in one layer's backward (as the code writes
    # it: gathered / all-to-all'd / rotating tensors and their gradients), per copy: XLA
    # reuses buffers between the forward and backward halves.
    "attention_copies": 0.5,
    # The same for the ring's rotating blocks and accumulators: XLA overlaps them with the
    # layer's other backward buffers more than the gathered or head-sharded tensors.
    "ring_attention_copies": 0.35,
    # One layer's backward MLP intermediates, in units of 5 [b, tokens, d_ff] (gate, up,
    # silu(gate) * up and two gradients; tokens: one chunk with remat.mlp_chunk_tokens).
    "layer_backward": 1.0,
    # [b, s_l, d_model] compute-dtype tensors alive in one layer's backward (inputs,
    # residuals, norms, projections and their gradients).
    "layer_width_tensors": 7.0,
    # Saved named tensors (minimal, custom) per copy the policy implies: XLA keeps the
    # scan's stacked residuals and a relayout of some of them.
    "saved_copies": 1.5,
    # Compute-dtype copies of the stacked layer weights: the hoisted casts (one) and
    # relayouts for the backward's transposed matmuls; also absorbs buffer-assignment
    # overhead that grows with the model (Llama 3.1 8B).
    "weight_copies": 2.75,
    # f32 gradient buffers in the layers' backward.
    "gradient_copies": 1.0,
    # Copies of the gathered output weights (compute dtype) in the loss backward.
    "head_weight_copies": 1.0,
    # One chunk's f32 logits: the logits and their softmax / gradient.
    "logits_copies": 1.4,
}


# ------------------------------------------------------------------- shapes ----

@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]   # logical axis names (trainer/model.py)
    per_layer: bool


def parameter_tensors(recipe: Recipe) -> list[Tensor]:
    """The model's parameters as trainer/model.py creates them (layers stacked)."""
    m = recipe.model
    e, h, kv, d, f, v = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab
    tensors = [
        Tensor("embedding", (v, e), ("vocab", "embed"), False),
        Tensor("attention_norm", (e,), ("embed",), True),
        Tensor("wq", (e, h, d), ("embed", "heads", "head_dim"), True),
        Tensor("wk", (e, kv, d), ("embed", "kv_heads", "head_dim"), True),
        Tensor("wv", (e, kv, d), ("embed", "kv_heads", "head_dim"), True),
        Tensor("wo", (h, d, e), ("heads", "head_dim", "embed"), True),
        Tensor("mlp_norm", (e,), ("embed",), True),
        Tensor("gate", (e, f), ("embed", "mlp"), True),
        Tensor("up", (e, f), ("embed", "mlp"), True),
        Tensor("down", (f, e), ("mlp", "embed"), True),
        Tensor("final_norm", (e,), ("embed",), False),
    ]
    if not m.tie_embeddings:
        tensors.append(Tensor("unembedding", (e, v), ("embed", "vocab"), False))
    return tensors


def _logical_sizes(axis_sizes: dict[str, int]) -> dict[str, int]:
    """Mesh size behind each logical axis (parallel/sharding.py LOGICAL_TO_MESH)."""
    zero = axis_sizes["fsdp"] * axis_sizes["context"]   # fsdp x context x ulysses
    t = axis_sizes["tensor"]
    return {"embed": zero, "heads": t, "kv_heads": t, "mlp": t, "vocab": t}


def local_elements(tensor: Tensor, axis_sizes: dict[str, int],
                   shard: Iterable[str] | None = None) -> int:
    """Elements of one device's shard (one layer's for per-layer tensors); a dimension
    its mesh axes do not divide stays whole, as in parallel/sharding.logical_spec.
    `shard` limits which logical axes are split (default: all)."""
    sizes = _logical_sizes(axis_sizes)
    count = 1
    for dim, axis in zip(tensor.shape, tensor.axes):
        size = sizes.get(axis, 1) if (shard is None or axis in shard) else 1
        count *= dim // size if dim % size == 0 else dim
    return count


def count_parameters(recipe: Recipe) -> int:
    layers = recipe.model.layers
    return sum(math.prod(t.shape) * (layers if t.per_layer else 1)
               for t in parameter_tensors(recipe))


# ------------------------------------------------------------------ results ----

@dataclasses.dataclass
class StrategyPlan:
    strategy: str
    ulysses: int                                  # Ulysses degree (usp); 1 otherwise
    memory: dict[str, float]                      # HBM bytes per device by term
    peak_terms: tuple[str, ...]                   # the terms alive together at the peak
    peak_phase: str                               # "loss" or "layers"
    host: dict[str, float]                        # pinned host bytes per device by term
    comm: dict[str, float]                        # bytes received per step per device, by kind
    comm_detail: dict[str, float]                 # the same by source (zero3, strategy, ...)
    compute_s: float                              # step compute at peak (with recompute)
    comm_s: float                                 # step communication at link bandwidth
    exposed_s: float                              # the part of comm_s on the critical path
    model_flops: float                            # per device per step (no recompute)
    peak_flops: float
    ring_hidden: bool | None                      # ring/usp: a step's send hides behind its compute
    hbm_capacity: float
    host_capacity: float
    compiled: dict | None = None                  # --compile: XLA's own figures

    @property
    def name(self) -> str:
        return f"usp(u={self.ulysses})" if self.strategy == "usp" else self.strategy

    @property
    def hbm_bytes(self) -> float:
        """Peak HBM per device: the terms of the whole step plus the larger phase."""
        return sum(self.memory[t] for t in self.peak_terms)

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values())

    @property
    def comm_bytes(self) -> float:
        return sum(self.comm.values())

    @property
    def step_s(self) -> float:
        """Estimated step time: the compute, or the traffic that can overlap it (weights,
        gradients, the ring's sends while they hide), whichever is longer, plus the
        traffic the next operation waits for (K/V gathers, all-to-alls, exposed sends)."""
        return max(self.compute_s, self.comm_s - self.exposed_s) + self.exposed_s

    @property
    def mfu_bound(self) -> float:
        """Model flops over peak x estimated step time: no kernel is faster than peak and
        no collective faster than the link bandwidth, so the real MFU is lower."""
        return min(self.model_flops / (self.peak_flops * max(self.step_s, 1e-30)), 1.0)

    @property
    def fits(self) -> bool:
        """The estimate fits in HBM_HEADROOM of the chip's HBM and in its host memory."""
        return (self.hbm_bytes <= HBM_HEADROOM * self.hbm_capacity
                and self.host_bytes <= self.host_capacity)

    @property
    def deciding_hbm_bytes(self) -> float:
        """The peak the recommendation goes by: XLA's when compiled (--compile), else (or
        where XLA refused the program) the estimate."""
        compiled = (self.compiled or {}).get("hbm_bytes")
        return self.hbm_bytes if compiled is None else compiled

    @property
    def deciding_fits(self) -> bool:
        """Whether the recommendation counts this strategy as fitting: by XLA's figures in
        the chip's whole HBM when compiled, else by the estimate within HBM_HEADROOM."""
        if self.compiled is None:
            return self.fits
        return self.compiled_json()["compiled_fits"]

    def as_json(self) -> dict:
        out = {
            "strategy": self.strategy, "ulysses": self.ulysses,
            "hbm_bytes_per_device": int(self.hbm_bytes),
            "host_bytes_per_device": int(self.host_bytes),
            "comm_bytes_per_step": int(self.comm_bytes),
            "comm_bytes_by_kind": {k: int(v) for k, v in self.comm.items()},
            "comm_bytes_by_source": {k: int(v) for k, v in self.comm_detail.items()},
            "memory_bytes_by_term": {k: int(v) for k, v in self.memory.items()},
            "memory_peak_phase": self.peak_phase,
            "memory_terms_at_peak": list(self.peak_terms),
            "host_bytes_by_term": {k: int(v) for k, v in self.host.items()},
            "compute_time_s": self.compute_s, "comm_time_s": self.comm_s,
            "exposed_comm_time_s": self.exposed_s, "step_time_s": self.step_s,
            "mfu_upper_bound": self.mfu_bound, "ring_comm_hidden": self.ring_hidden,
            "fits": self.fits,
        }
        if self.compiled is not None:
            out.update(self.compiled_json())
        return out

    def compiled_json(self) -> dict:
        c = self.compiled
        hbm, host = c.get("hbm_bytes"), c.get("host_bytes")
        return {
            "compiled_hbm_bytes_per_device": hbm,
            "compiled_host_bytes_per_device": host,
            "compiled_comm_bytes_by_kind": c.get("collective_bytes"),
            "compiled_comm_bytes_per_step": (sum(c["collective_bytes"].values())
                                             if c.get("collective_bytes") else None),
            "hbm_gap_percent": gap_percent(self.hbm_bytes, hbm),
            "comm_gap_percent": (gap_percent(self.comm_bytes,
                                             sum(c["collective_bytes"].values()))
                                 if c.get("collective_bytes") else None),
            "compiled_fits": (hbm is not None and hbm <= self.hbm_capacity
                              and (host or 0) <= self.host_capacity),
            "compile_error": c.get("error"),
        }


def gap_percent(estimate: float, compiled: float | None) -> float | None:
    """(estimate - compiled) / compiled in %, None without a compiled figure."""
    if not compiled:
        return None
    return 100.0 * (estimate - compiled) / compiled


@dataclasses.dataclass
class Plan:
    chip: Chip
    axis_sizes: dict[str, int]
    plans: list[StrategyPlan]
    skipped: dict[str, str]                       # strategy -> why it cannot run here
    choice: StrategyPlan | None
    reason: str

    def as_json(self) -> dict:
        return {
            "chip": self.chip.name, "hbm_bytes_per_device": self.chip.hbm_bytes,
            "host_bytes_per_device": self.chip.host_bytes, "mesh": self.axis_sizes,
            "strategies": [p.as_json() for p in self.plans],
            "not_applicable": self.skipped,
            "recommendation": None if self.choice is None else {
                "strategy": self.choice.strategy, "ulysses": self.choice.ulysses,
                "reason": self.reason},
        }


# ---------------------------------------------------------------- candidates ----

def ulysses_degree_limit(recipe: Recipe, axis_sizes: dict[str, int]) -> int:
    """Largest Ulysses degree dividing both the query heads per tensor shard and
    mesh.context (parallel/ulysses.check_ulysses_degree)."""
    return math.gcd(recipe.model.n_heads // axis_sizes["tensor"], axis_sizes["context"])


def candidates(recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu"
               ) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """[(strategy, ulysses degree)] the mesh allows, and why the others are left out."""
    c = axis_sizes["context"]
    if c == 1:
        return [("none", 1)], {s: "mesh.context is 1" for s in SIMPLICITY if s != "none"}
    skipped = {"none": f"mesh.context is {c}"}
    limit = ulysses_degree_limit(recipe, axis_sizes)
    heads = recipe.model.n_heads // axis_sizes["tensor"]
    out = [("all_gather", 1)]
    if limit == c:
        out.append(("ulysses", 1))
    else:
        skipped["ulysses"] = (f"the {heads} query heads per tensor shard do not split "
                              f"{c} ways")
    # usp: the largest Ulysses degree the heads allow that still leaves a ring (u == c
    # would be ulysses itself).
    usp = max((u for u in range(2, c) if c % u == 0 and limit % u == 0), default=None)
    if usp:
        out.append(("usp", usp))
    else:
        skipped["usp"] = "no Ulysses degree between 1 and mesh.context divides the heads"
    out.append(("ring", 1))
    for strategy, ulysses in out:
        variant = recipe_for_strategy(recipe, strategy, ulysses)
        try:
            check_kernel_layout(variant, axis_sizes,
                                STRATEGIES[strategy].kernel_lengths(variant, axis_sizes), platform)
        except RecipeError as err:  # splash's or (on TPU) Pallas's tiles do not fit
            skipped[strategy] = str(err).removeprefix("recipe key 'attention.impl' = 'splash': ")
    return [(s, u) for s, u in out if s not in skipped], skipped


# ------------------------------------------------------------------ estimate ----

@dataclasses.dataclass(frozen=True)
class _Dims:
    b: int          # rows per device per micro-batch
    rows: int       # rows per device per step (all micro-batches)
    accum: int
    s: int          # sequence length
    c: int          # context degree (ring x ulysses)
    u: int          # Ulysses degree (ulysses: c; usp: parallel.ulysses; else 1)
    r: int          # ring degree (ring: c; usp: c/u; else 1)
    t: int
    z: int          # ZeRO-3 group (fsdp x context)
    g: int          # gradient group (data x fsdp x context)
    p: int          # compute dtype bytes
    e: int
    h: int          # query heads per tensor shard
    kv: int         # KV heads per tensor shard (at least 1)
    d: int
    f: int          # d_ff per tensor shard
    v: int          # vocabulary per tensor shard
    layers: int

    @property
    def s_l(self) -> int:
        return self.s // self.c


def _dims(recipe: Recipe, axis_sizes: dict[str, int], strategy: str, ulysses: int) -> _Dims:
    m, a = recipe.model, axis_sizes
    t, c = a["tensor"], a["context"]
    accum = recipe.train.grad_accum_steps
    rows = max(recipe.data.batch_size // (a["data"] * a["fsdp"]), 1)
    u = {"ulysses": c, "usp": ulysses}.get(strategy, 1)
    r = {"ring": c, "usp": c // max(ulysses, 1)}.get(strategy, 1)
    vocab_split = t if m.vocab % t == 0 else 1
    return _Dims(b=max(rows // accum, 1), rows=rows, accum=accum, s=recipe.data.seq_len,
                 c=c, u=u, r=r, t=t, z=a["fsdp"] * c, g=a["data"] * a["fsdp"] * c,
                 p=BYTES[m.dtype], e=m.d_model, h=m.n_heads // t, kv=max(m.n_kv_heads // t, 1),
                 d=m.head_dim, f=m.d_ff // t, v=m.vocab // vocab_split, layers=m.layers)


def loss_chunks(recipe: Recipe, c: int) -> tuple[int, int]:
    """(number of chunks, tokens per chunk per sequence per device) as trainer/loss.py
    cuts the local part of the sequence."""
    from lctrain.trainer.loss import resolve_chunk_tokens   # numpy-free, jax-free helper
    s = recipe.data.seq_len
    chunk = resolve_chunk_tokens(recipe.loss.chunk_tokens, s)
    part = s // c
    if chunk == s:
        return 1, part
    piece_limit = max(chunk // c, 1)
    n = -(-part // piece_limit)
    return n, -(-part // n)


def mlp_chunk_len(recipe: Recipe, c: int) -> int:
    """Tokens per sequence per device the MLP works on at a time (remat.mlp_chunk_tokens,
    cut as trainer/token_chunks.py cuts them)."""
    s = recipe.data.seq_len
    chunks = chunks_for(recipe.remat.mlp_chunk_tokens, s, c)
    return chunks.piece_len if chunks else s // c


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


def _remat_tensors(recipe: Recipe, dm: _Dims) -> dict[str, float]:
    """Bytes per token of each named tensor of one layer (trainer/model.py names)."""
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


def _saved_per_token(recipe: Recipe, dm: _Dims, strategy: str) -> tuple[float, float, bool]:
    """(device bytes, host bytes) saved per token per layer for backward, and whether the
    attention forward is recomputed in backward (its kernel residuals are not kept)."""
    named = _remat_tensors(recipe, dm)
    policy = recipe.remat.policy
    if policy == "full":
        return named["decoder_layer_input"], 0.0, True
    if policy == "minimal":
        return (named["decoder_layer_input"] + CALIBRATION["saved_copies"]
                * sum(v for n, v in named.items() if n != "decoder_layer_input")), 0.0, True
    if policy == "save_all":
        # No remat: every intermediate the backward reads stays, including f32 norm and
        # RoPE temporaries and the kernel's residuals (q, k after RoPE, out, lse).
        extra = (2 * dm.e * F32                      # the two RMSNorms' f32 inputs
                 + (dm.h + dm.kv) * dm.d * dm.p      # q, k after RoPE
                 + dm.h * F32                        # lse
                 + 2 * dm.f * dm.p)                  # silu(gate), silu(gate) * up
        return sum(named.values()) + extra, 0.0, False
    device = CALIBRATION["saved_copies"] * sum(
        named[n] for n, where in recipe.remat.tensors.items()
        if where == "device" and n != "decoder_layer_input")
    host = sum(named[n] for n, where in recipe.remat.tensors.items() if where == "offload")
    # The scan carry (the layer input) is always kept unless it was offloaded.
    if recipe.remat.tensors.get("decoder_layer_input") != "offload":
        device += named["decoder_layer_input"]
    return device, host, True


def estimate(recipe: Recipe, axis_sizes: dict[str, int], chip: Chip, strategy: str,
             ulysses: int = 1, platform: str = "tpu") -> StrategyPlan:
    """The analytic plan of one strategy (see the module docstring for every term)."""
    dm = _dims(recipe, axis_sizes, strategy, ulysses)
    tensors = parameter_tensors(recipe)
    L, p, b, s, s_l = dm.layers, dm.p, dm.b, dm.s, dm.s_l
    params_local = sum(local_elements(t, axis_sizes) * (L if t.per_layer else 1)
                       for t in tensors)
    layer_local = sum(local_elements(t, axis_sizes) for t in tensors if t.per_layer)
    layer_matrices = [t for t in tensors if t.per_layer and len(t.shape) > 1]
    norms = [t for t in tensors if t.per_layer and len(t.shape) == 1]
    # One layer's matrices gathered over Z (split over tensor only).
    layer_gathered = sum(local_elements(t, axis_sizes, shard=("heads", "kv_heads", "mlp"))
                         for t in layer_matrices)
    by_name = {t.name: t for t in tensors}
    # remat.mlp_chunk_tokens: the MLP matrices are gathered once before the chunk loop and
    # kept float32 there, their gradient summed over the chunks and reduced in float32.
    mlp_chunked = chunks_for(recipe.remat.mlp_chunk_tokens, recipe.data.seq_len, dm.c) is not None
    mlp_gathered = sum(local_elements(by_name[name], axis_sizes, shard=("mlp",))
                       for name in ("gate", "up", "down")) if mlp_chunked else 0
    head = by_name.get("unembedding") or by_name["embedding"]
    head_full = local_elements(head, axis_sizes, shard=("vocab",))
    embed_full = local_elements(by_name["embedding"], axis_sizes, shard=("vocab",))
    n_chunks, chunk_tokens = loss_chunks(recipe, dm.c)
    impl = kernel_impl(recipe_for_strategy(recipe, strategy, ulysses), platform, axis_sizes)
    tokens = b * s_l                                  # per device per micro-batch
    mlp_tokens = b * mlp_chunk_len(recipe, dm.c)      # the MLP's [tokens, d_ff] at a time
    kv_heads_u = math.lcm(dm.kv, dm.u) if dm.u > 1 and dm.kv % dm.u else dm.kv

    # ---------------------------------------------------------------- memory --
    # Live for the whole step: the state, the batch, the compute-dtype weight stacks, what
    # the remat policy saves. On top of them, the larger of two phases: the loss (its
    # backward starts the backward pass) and one layer's backward.
    saved_token, host_token, attention_recomputed = _saved_per_token(recipe, dm, strategy)
    rows_all = dm.rows * s_l                          # tokens per device per step
    embedding_table_grad = embed_full * F32 * 2 * (dm.g - 1) / dm.g <= rows_all * dm.e * F32
    memory: dict[str, float] = {
        "state": 12 * params_local,
        "batch": 5 * 4 * dm.rows * s_l,
        "weight_copies": CALIBRATION["weight_copies"] * p * layer_local * L if p < F32 else 0,
        "activations": L * tokens * saved_token,
        # loss phase: the output weights gathered (compute dtype) and their full f32
        # gradient, one chunk's f32 logits (and softmax / gradient), the hidden states
        # cut into chunks and their gradient
        "loss_head": head_full * (F32 + CALIBRATION["head_weight_copies"] * p),
        "loss_logits": (CALIBRATION["logits_copies"] * b * chunk_tokens * dm.v * F32
                        + (2 * tokens * dm.e * p if n_chunks > 1 else 0)),
        # layer phase: f32 gradients (sharded), one layer's weights gathered (and the next
        # one's, prefetched) and its full gradient in the compute dtype, the layer's
        # recomputed intermediates, the attention's working set
        "gradients": CALIBRATION["gradient_copies"] * F32 * params_local,
        # the embedding's full f32 gradient, where XLA all-reduces the table (see comm)
        "embedding_gradient": F32 * embed_full if embedding_table_grad else 0.0,
        "layer_weights": 3 * p * layer_gathered + 2 * F32 * mlp_gathered,
        "layer_backward": (CALIBRATION["layer_backward"] * mlp_tokens * 5 * dm.f * p
                           + CALIBRATION["layer_width_tensors"] * tokens * dm.e * p),
    }
    memory.update(_attention_memory(dm, strategy, impl, recipe, platform))
    memory["attention"] *= CALIBRATION["ring_attention_copies" if dm.r > 1 else
                                       "attention_copies"]
    if recipe.remat.policy == "save_all":
        memory["activations"] += L * _kernel_residuals(dm, strategy)
    host = {"offloaded_activations": L * tokens * host_token} if host_token else {}
    if getattr(getattr(recipe, "optimizer", None), "offload", False):
        # optimizer.offload keeps AdamW's moments in pinned host memory between steps;
        # the step copies them in at its start (XLA schedules it early), so the device
        # still holds them at the peak.
        host["optimizer_moments"] = 8 * params_local
    phases = {"loss": ("loss_head", "loss_logits"),
              "layers": ("gradients", "embedding_gradient", "layer_weights", "layer_backward",
                         "attention", "kernel_scratch")}
    peak_phase = max(phases, key=lambda ph: sum(memory.get(t, 0.0) for t in phases[ph]))
    outside = {t for ph, names in phases.items() if ph != peak_phase for t in names}
    peak_terms = tuple(t for t in memory if t not in outside)

    # ----------------------------------------------------------- communication --
    zf = (dm.z - 1) / dm.z
    gf = 2 * (dm.g - 1) / dm.g
    detail: dict[str, tuple[str, float]] = {}
    detail["zero3_weights"] = ("all-gather", 2 * L * layer_gathered * p * zf
                               + 6 * L * dm.e * F32 * zf)
    detail["gradients"] = ("all-reduce", L * (layer_gathered * p + mlp_gathered * (F32 - p)) * gf
                           + L * len(norms) * dm.e * F32 * gf)
    # The output weights are gathered for each chunk's forward and again for its
    # recomputation in backward. trainer/loss.py all-reduces each chunk's gradient in the
    # compute dtype; unchunked, XLA all-reduces it in f32, or for a head whose f32
    # gradient passes HEAD_GRADIENT_F32_LIMIT in the compute dtype (observed: f32 for
    # 1024 x 32768, bf16 for Llama 3.1 8B's 4096 x 128256).
    detail["loss_head_weights"] = ("all-gather", 2 * n_chunks * head_full * p * zf)
    head_grad_bytes = p if n_chunks > 1 or head_full * F32 > HEAD_GRADIENT_F32_LIMIT else F32
    detail["loss_head_gradient"] = ("all-reduce", (n_chunks * head_full * head_grad_bytes
                                                   + dm.e * F32) * gf)
    # The embedding's backward: XLA either sends the f32 cotangent of the looked-up rows
    # back to the width shards (all-to-all) or all-reduces the full f32 table gradient;
    # it picks the smaller (the table for a small vocabulary).
    table = ("all-reduce", embed_full * F32 * gf)
    rows_back = ("all-to-all", rows_all * dm.e * F32 * zf)
    detail["embedding_gradient"] = min(table, rows_back, key=lambda kb: kb[1])
    detail["token_ids"] = ("all-gather", rows_all * dm.z * (INT32 + 1) * zf)
    passes = 2 if attention_recomputed else 1          # forward runs of attention per step
    for source, (kind, nbytes) in _strategy_comm(dm, strategy, passes, kv_heads_u,
                                                 recipe).items():
        detail[source] = (kind, nbytes)
    # With gradient accumulation every micro-batch repeats all of it (the sharded
    # gradient accumulator is reduced into per micro-batch too).
    detail = {source: (kind, nbytes * dm.accum) for source, (kind, nbytes) in detail.items()}
    comm = dict.fromkeys(KINDS, 0.0)
    for kind, nbytes in detail.values():
        comm[kind] += nbytes

    # -------------------------------------------------------------- time --
    flops = _flops_per_device(recipe, axis_sizes, strategy)
    compute_s = flops["hardware"] / chip.peak_bf16_flops
    seconds = {source: nbytes / _bandwidth(chip, kind)
               for source, (kind, nbytes) in detail.items()}
    comm_s = sum(seconds.values())
    # On the critical path: the strategy's gathers and all-to-alls (attention waits for
    # them); the ring's sends only where a step's send outlasts the step's attention.
    exposed_s = sum(t for source, t in seconds.items()
                    if source.startswith("strategy_") and source != "strategy_ring")
    hidden = None
    if strategy in ("ring", "usp"):
        ratio = _ring_work_over_send(dm, chip, strategy)
        hidden = ratio >= 1
        exposed_s += seconds["strategy_ring"] * max(0.0, 1 - ratio)
        compute_s += _ring_merge_seconds(dm, chip, strategy, passes)
    return StrategyPlan(
        strategy=strategy, ulysses=ulysses if strategy == "usp" else 1, memory=memory,
        peak_terms=peak_terms, peak_phase=peak_phase, host=host, comm=comm,
        comm_detail={source: nbytes for source, (_, nbytes) in detail.items()},
        compute_s=compute_s, comm_s=comm_s, exposed_s=exposed_s, model_flops=flops["model"],
        peak_flops=chip.peak_bf16_flops, ring_hidden=hidden, hbm_capacity=chip.hbm_bytes,
        host_capacity=chip.host_bytes)


def _kernel_residuals(dm: _Dims, strategy: str) -> float:
    """save_all: what the attention kernel keeps per layer (its custom VJP residuals)."""
    tokens = dm.b * dm.s_l
    local = tokens * (2 * dm.h * dm.d * dm.p + dm.h * F32)      # q, out, lse
    if strategy == "all_gather":
        return local + 2 * dm.b * dm.s * dm.kv * dm.d * dm.p       # gathered K, V
    return local + 2 * tokens * dm.kv * dm.d * dm.p


def _attention_memory(dm: _Dims, strategy: str, impl: str, recipe: Recipe,
                      platform: str) -> dict[str, float]:
    """The attention's memory terms: `attention` (the strategy's working set in one
    layer's backward) and `kernel_scratch` (the kernel's block scores or layout copies)."""
    b, s, s_l, p, d = dm.b, dm.s, dm.s_l, dm.p, dm.d
    bq, bkv = recipe.attention.block_q, recipe.attention.block_kv
    ids = 2 * INT32                                   # positions + segment ids per token
    terms: dict[str, float] = {}
    if strategy in ("none", "all_gather"):
        sq, skv, heads, kv = s_l, s, dm.h, dm.kv
        # gathered K, V (+ ids) and their f32 gradients before the reduce-scatter; the
        # local q, out, dout (compute dtype) and f32 dq
        terms["attention"] = (b * skv * (2 * kv * d * (p + F32) + ids)
                              + b * sq * heads * d * (3 * p + F32))
    elif strategy == "ulysses":
        sq, skv, heads = s, s, dm.h // dm.u
        kv = max(math.lcm(dm.kv, dm.u) // dm.u, 1)
        # head-sharded q, out, dout (compute dtype), dq f32; k, v and f32 dk, dv
        terms["attention"] = b * s * (heads * d * (3 * p + F32) + 2 * kv * d * (p + F32) + ids)
    else:   # ring, usp: the ring runs over r chips with s/r tokens of h/u heads each
        heads = dm.h // dm.u
        kv = max(math.lcm(dm.kv, dm.u) // dm.u, 1) if dm.u > 1 else dm.kv
        sq = skv = s // dm.r
        chunk = b * sq
        # K, V, ids in flight (current + next), f32 dK, dV (current + next), f32 out/dq
        # accumulators and lse, q/out/dout in the compute dtype
        terms["attention"] = chunk * (2 * (2 * kv * d * p + ids) + 2 * 2 * kv * d * F32
                                      + heads * d * (2 * F32 + 3 * p) + heads * F32)
    if impl in ("pallas", "splash"):
        # The Pallas kernels (ours and splash) work head-major: q, k, v, out, dout are
        # transposed in XLA ([b, h, s, d]) as the kernel sees them.
        terms["kernel_scratch"] = CALIBRATION["pallas_layout_copies"] * b * d * p * (
            3 * sq * heads + 2 * skv * kv)
    if impl == "splash":
        # splash writes its logsumexp 128 lanes wide ([heads, sq, 128] f32) before keeping
        # lane 0 (1M tokens on 4 v5p chips, ring: +4.2 GB over our kernel, compiled)
        terms["kernel_scratch"] += b * heads * sq * SPLASH_LSE_LANES * F32
    if impl == "xla":
        block_q, block_kv = min(bq, sq), min(bkv, skv)
        terms["kernel_scratch"] = (CALIBRATION["kernel_block_scores"]
                                   * b * heads * block_q * block_kv * F32)
    return terms


def _strategy_comm(dm: _Dims, strategy: str, passes: int, kv_heads_u: int,
                   recipe: Recipe) -> dict[str, tuple[str, float]]:
    """Bytes the strategy's own collectives deliver to one device per micro-batch."""
    b, s, s_l, p, d, L = dm.b, dm.s, dm.s_l, dm.p, dm.d, dm.layers
    ids = 2 * INT32
    out: dict[str, tuple[str, float]] = {}
    if strategy == "all_gather":
        share = (dm.c - 1) / dm.c
        kv_full = b * s * dm.kv * d * p
        out["strategy_kv"] = ("all-gather", (passes * L * 2 * kv_full
                                             + (passes - 1) * L * b * s * ids + b * s * ids)
                              * share)
        # Autodiff turns the gather into a reduce-scatter of dK, dV; XLA lowers it as
        # one up to DKV_REDUCE_SCATTER_LIMIT bytes of dK + dV per layer, and as an
        # all-reduce (twice the bytes) beyond (observed: 17 MB reduce-scattered, 67 MB
        # mixed, 537 MB all-reduced).
        dkv = 2 * b * s * dm.kv * d * p
        if dkv <= DKV_REDUCE_SCATTER_LIMIT:
            out["strategy_dkv"] = ("reduce-scatter", L * dkv / dm.c * (dm.c - 1))
        else:
            out["strategy_dkv"] = ("all-reduce", L * dkv * 2 * (dm.c - 1) / dm.c)
    if strategy in ("ulysses", "usp"):
        u = dm.u
        q_local = b * s_l * dm.h * d * p
        kv_local = b * s_l * kv_heads_u * d * p
        # forward: q, k, v, out; each recomputation again (minimal keeps `context`, so its
        # recomputation skips out's all-to-all back); backward: dout, dq, dk, dv.
        recompute_out = 0 if recipe.remat.policy == "minimal" else 1
        per_layer = (2 * q_local + 2 * kv_local) * 2 \
            + (passes - 1) * (q_local * (1 + recompute_out) + 2 * kv_local)
        out["strategy_all_to_all"] = ("all-to-all", L * per_layer * (u - 1) / u)
        # positions and segment ids gathered over the Ulysses group per forward pass
        out["strategy_ids"] = ("all-gather", ((passes - 1) * L + 1) * b * s_l * u * ids
                               * (u - 1) / u)
    if strategy in ("ring", "usp"):
        r = dm.r
        chunk = b * (s // r) if strategy == "usp" else b * s_l
        heads = dm.kv // dm.u if strategy == "usp" and dm.kv % dm.u == 0 else (
            max(kv_heads_u // dm.u, 1) if strategy == "usp" else dm.kv)
        kv = chunk * heads * d * p
        tok = chunk * ids
        # forward (and each recomputation): r sends of K, V, ids; the first forward's id
        # rotations are the same in every layer, hoisted: r sends per step, not per layer.
        # backward: r sends of K, V, ids and the f32 dK, dV accumulators.
        forward = passes * L * r * 2 * kv + ((passes - 1) * L + 1) * r * tok
        backward = L * r * (2 * kv + 2 * kv * F32 / p + tok)
        out["strategy_ring"] = ("collective-permute", forward + backward)
    return out


def _ring_merge_seconds(dm: _Dims, chip: Chip, strategy: str, passes: int) -> float:
    """Memory-bound work the ring adds per step: the forward rescales and adds its f32
    output accumulator ([b, s/r, h/u, d], read twice, written once, plus the block's
    output), the backward adds into f32 dq, dK, dV (read and written). At HBM bandwidth."""
    if not chip.hbm_bytes_per_s:
        return 0.0
    chunk = dm.b * (dm.s // dm.r)
    heads = dm.h // dm.u if strategy == "usp" else dm.h
    kv = max(dm.kv // dm.u, 1) if strategy == "usp" else dm.kv
    forward = chunk * heads * dm.d * (3 * F32 + dm.p)
    backward = chunk * (heads + 2 * kv) * dm.d * 2 * F32
    per_layer = dm.r * (passes * forward + backward)
    return dm.accum * dm.layers * per_layer / chip.hbm_bytes_per_s


def _bandwidth(chip: Chip, kind: str) -> float:
    """Bytes/s one device receives for a collective kind: the ring's collective-permute
    uses one link (one direction); XLA's all-gather, reduce-scatter, all-reduce and
    all-to-all run bidirectional rings, two links."""
    links = 1 if kind == "collective-permute" else min(2, chip.links)
    return chip.link_bytes_per_s * links


def _flops_per_device(recipe: Recipe, axis_sizes: dict[str, int], strategy: str) -> dict:
    """Model flops (trainer/metrics.training_flops_per_token) and hardware flops (plus
    what remat recomputes) per device per step."""
    m = recipe.model
    devices = math.prod(axis_sizes.values())
    tokens = recipe.data.batch_size * recipe.data.seq_len
    params = count_parameters(recipe)
    attention_fwd = 2 * m.layers * recipe.data.seq_len * m.n_heads * m.head_dim  # causal
    model = tokens * (6 * params + 3 * attention_fwd)
    extra = 0
    layer_params = params - m.vocab * m.d_model * (1 if m.tie_embeddings else 2) - m.d_model
    if recipe.remat.policy in ("full",):
        extra = tokens * (2 * layer_params + attention_fwd)
    elif recipe.remat.policy in ("minimal", "custom"):
        extra = tokens * attention_fwd
    n_chunks = loss_chunks(recipe, axis_sizes["context"])[0]
    if n_chunks > 1:        # the chunked loss recomputes each chunk's logits in backward
        extra += tokens * 2 * m.d_model * m.vocab
    return {"model": model / devices, "hardware": (model + extra) / devices}


def _ring_work_over_send(dm: _Dims, chip: Chip, strategy: str) -> float:
    """One ring step's attention time over its K/V send time (one link): >= 1 means the
    send hides behind the work. Forward step: 2 b (s/r) kv d p bytes against
    4 b (s/r)^2 (h/u) d / 2 flops (with load balancing half of each block pair is
    causal-masked on average; the backward moves 3x the bytes for 2.5x the flops)."""
    chunk = dm.b * (dm.s // dm.r)
    heads = dm.h // dm.u if strategy == "usp" else dm.h
    kv = max(dm.kv // dm.u, 1) if strategy == "usp" else dm.kv
    send = 2 * chunk * kv * dm.d * dm.p / chip.link_bytes_per_s
    work = 2 * chunk * (dm.s // dm.r) * heads * dm.d / chip.peak_bf16_flops
    return work / send


# ------------------------------------------------------------------- planning ----

def plan(recipe: Recipe, chip: Chip, axis_sizes: dict[str, int],
         platform: str = "tpu") -> Plan:
    """Estimates every strategy the mesh allows and recommends one."""
    options, skipped = candidates(recipe, axis_sizes, platform)
    plans = [estimate(recipe, axis_sizes, chip, s, u, platform) for s, u in options]
    choice, reason = recommend(plans)
    return Plan(chip, axis_sizes, plans, skipped, choice, reason)


def recommend(plans: list[StrategyPlan]) -> tuple[StrategyPlan | None, str]:
    """Among the plans that fit (StrategyPlan.deciding_fits: compiled figures where there
    are any), the fastest estimated step (StrategyPlan.step_s); within TIE of it, the
    simplest. If none fits, the one that needs the least HBM."""
    if not plans:
        return None, "no strategy applies"
    gib = 2**30
    source = "compiled" if any(p.compiled for p in plans) else "estimated"
    fitting = [p for p in plans if p.deciding_fits]
    if not fitting:
        best = min(plans, key=lambda p: p.deciding_hbm_bytes)
        return best, (f"none fits in {best.hbm_capacity / gib:.0f} GiB; {best.name} needs "
                      f"the least ({best.deciding_hbm_bytes / gib:.2f} GiB per device, "
                      f"{source})")
    fastest = min(p.step_s for p in fitting)
    near = [p for p in fitting if p.step_s <= TIE * fastest]
    best = min(near, key=lambda p: SIMPLICITY.index(p.strategy))
    bound = "communication" if best.comm_s > best.compute_s else "compute"
    others = [p.name for p in plans if not p.deciding_fits]
    speed = "fastest" if best.step_s == fastest else "near-fastest"
    reason = (f"fits ({best.deciding_hbm_bytes / gib:.2f} of {best.hbm_capacity / gib:.0f} "
              f"GiB per device, {source}) with the {speed} estimated step ({bound}-bound, "
              f"MFU <= {best.mfu_bound:.0%})")
    if len(near) > 1:
        reason += f"; simplest of {', '.join(p.name for p in near)} (within {TIE - 1:.1%})"
    if others:
        reason += f"; {', '.join(others)} would not fit"
    return best, reason


def sequence_quantum(recipe: Recipe, axis_sizes: dict[str, int]) -> int:
    """Step between sequence lengths the recipe accepts on this mesh (divisible by 2 x
    context with load balancing) and the kernels block evenly (multiples of 128)."""
    c = axis_sizes["context"]
    chunks = 2 * c if recipe.parallel.load_balance and c > 1 else c
    return math.lcm(chunks, 128)


def max_fitting(fits: Callable[[int], bool], quantum: int, limit: int = 2**27,
                bisect_steps: int | None = None, start: int | None = None) -> int:
    """Longest multiple of `quantum` for which `fits` holds (0 if none does), assuming
    `fits` is monotone (true up to some length, false beyond): power-of-two steps from
    `start` (default: the smallest power-of-two multiple of `quantum`; doubling while it
    fits, halving while it does not), then bisection between the last length that fit and
    the first that did not (down to `quantum`, or `bisect_steps` halvings of the gap)."""
    first = quantum
    while first & (first - 1):      # the smallest power of two that quantum divides
        first += quantum
    point = first
    if start is not None:
        while point * 2 <= min(start, limit):
            point *= 2
    if fits(point):
        lo = point
        while lo * 2 <= limit and fits(lo * 2):
            lo *= 2
        hi = lo * 2
        if hi > limit:
            return lo
    else:
        hi = point
        while hi > first and not fits(hi // 2):
            hi //= 2
        lo = hi // 2 if hi > first else 0
    steps = 0
    while hi - lo > quantum and (bisect_steps is None or steps < bisect_steps):
        mid = (lo + hi) // 2 // quantum * quantum
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
        steps += 1
    return lo


def with_seq_len(recipe: Recipe, seq_len: int) -> Recipe:
    out = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=seq_len))
    return out


# ------------------------------------------------------- compiled figures ----

def recipe_for_strategy(recipe: Recipe, strategy: str, ulysses: int = 1) -> Recipe:
    """A copy of the recipe running `strategy` (usp with Ulysses degree `ulysses`)."""
    parallel = dataclasses.replace(recipe.parallel, strategy=strategy,
                                   ulysses=ulysses if strategy == "usp" else 1)
    return dataclasses.replace(recipe, parallel=parallel)


def compile_figures(recipe: Recipe, devices) -> dict:
    """XLA's own per-device figures for the recipe's train step on `devices` (a TPU
    topology from parallel.aot.topology_devices): {"hbm_bytes", "host_bytes",
    "collective_bytes"}, or {"hbm_bytes": None, "error": ...} when XLA refuses the program
    because its temporaries exceed the chip's HBM (it does not fit)."""
    from lctrain.parallel import aot
    try:
        stats = aot.compiled_stats(aot.compile_train_step(recipe, devices))
    except Exception as err:                      # XLA's RESOURCE_EXHAUSTED, as JaxRuntimeError
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        return {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
                "error": text.splitlines()[0][:300]}
    return {"hbm_bytes": stats.hbm_bytes,
            "host_bytes": stats.host_temp_bytes + stats.host_argument_bytes,
            "collective_bytes": dict(stats.collective_bytes),
            "temp_bytes": stats.temp_bytes, "argument_bytes": stats.argument_bytes}


def compiled_fits(figures: dict, chip: Chip) -> bool:
    return (figures.get("hbm_bytes") is not None and figures["hbm_bytes"] <= chip.hbm_bytes
            and (figures.get("host_bytes") or 0) <= chip.host_bytes)


# What the compiling functions wrap each compile in, given its label (the CLI shows a
# spinner and the elapsed time: each compile can take minutes).
Timer = Callable[[str], ContextManager]


def attach_compiled(result: Plan, recipe: Recipe, devices,
                    timed: Timer = lambda _: nullcontext()) -> None:
    """Compiles every strategy of the plan for `devices`, records XLA's figures and
    recommends again by them."""
    for strategy_plan in result.plans:
        variant = recipe_for_strategy(recipe, strategy_plan.strategy, strategy_plan.ulysses)
        with timed(f"compiled {strategy_plan.name}, seq {recipe.data.seq_len:,}, for "
                   f"{len(devices)} devices"):
            strategy_plan.compiled = compile_figures(variant, devices)
    result.choice, result.reason = recommend(result.plans)


# ------------------------------------------------------------- max seq ----

def max_seq_len(recipe: Recipe, axis_sizes: dict[str, int], chip: Chip, strategy: str,
                ulysses: int = 1, platform: str = "tpu", devices=None,
                bisect_steps: int | None = None, timed: Timer = lambda _: nullcontext()) -> int:
    """Longest sequence (a multiple of sequence_quantum) this strategy fits at, from the
    estimate, or by compiling when `devices` (a TPU topology) are given."""
    variant = recipe_for_strategy(recipe, strategy, ulysses)

    def fits(seq_len: int) -> bool:
        candidate = with_seq_len(variant, seq_len)
        if devices is not None:
            with timed(f"compiled {variant.parallel.strategy}, seq {seq_len:,}"):
                return compiled_fits(compile_figures(candidate, devices), chip)
        return estimate(candidate, axis_sizes, chip, strategy, ulysses, platform).fits

    quantum = sequence_quantum(recipe, axis_sizes)
    start = None
    if devices is not None:        # start the compiles where the estimate ends
        start = max_seq_len(recipe, axis_sizes, chip, strategy, ulysses, platform)
    return max_fitting(fits, quantum, bisect_steps=bisect_steps, start=start)


# Bisection steps of a compiled --max-seq search after the doubling (each is a compile).
COMPILED_BISECT_STEPS = 3


def longest_sequences(result: Plan, recipe: Recipe, platform: str = "tpu",
                      devices=None, timed: Timer = lambda _: nullcontext()
                      ) -> dict[str, dict[str, int]]:
    """{strategy name: {"estimated": longest sequence, "compiled": ... (with `devices`)}}
    for every plan of `result`."""
    longest = {}
    for p in result.plans:
        search = functools.partial(max_seq_len, recipe, result.axis_sizes, result.chip,
                                   p.strategy, p.ulysses, platform)
        longest[p.name] = {"estimated": search()}
        if devices is not None:
            longest[p.name]["compiled"] = search(devices, bisect_steps=COMPILED_BISECT_STEPS,
                                                 timed=timed)
    return longest


# ------------------------------------------------------------- rendering ----

def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:,.2f}"


def _seconds(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x >= 1e-3 else f"{x * 1e6:,.0f} us"


def render(result: Plan, console, title: str = "") -> None:
    """The plan as a rich table, one row per strategy, then the recommendation."""
    from rich.markup import escape
    from rich.table import Table

    compiled = any(p.compiled is not None for p in result.plans)
    # Escaped: a model folder (hf:<dir>) may hold square brackets, rich's markup.
    table = Table(title=escape(title) or None, title_justify="left")
    for name, justify in (("strategy", "left"), ("HBM\nGiB/device", "right"),
                          ("host\nGiB/device", "right"), ("comm\nGiB/step", "right"),
                          ("comm time /\ncompute time", "right"), ("MFU\nbound", "right"),
                          ("ring\nhidden", "center"), ("fits", "center")):
        table.add_column(name, justify=justify, no_wrap=True)
    if compiled:
        for name in ("XLA HBM\nGiB/device", "HBM\ngap", "XLA comm\nGiB/step", "comm\ngap"):
            table.add_column(name, justify="right", no_wrap=True)
    for p in result.plans:
        row = [p.name, _gib(p.hbm_bytes), _gib(p.host_bytes), _gib(p.comm_bytes),
               f"{_seconds(p.comm_s)} / {_seconds(p.compute_s)}", f"{p.mfu_bound:.0%}",
               {None: "-", True: "yes", False: "no"}[p.ring_hidden],
               "[green]yes[/]" if p.fits else "[red]no[/]"]
        if compiled:
            c = p.compiled_json() if p.compiled is not None else {}
            hbm_gap, comm_gap = c.get("hbm_gap_percent"), c.get("comm_gap_percent")
            row += [_gib(c.get("compiled_hbm_bytes_per_device"))
                    if c.get("compiled_hbm_bytes_per_device") is not None else "OOM",
                    "-" if hbm_gap is None else f"{hbm_gap:+.1f}%",
                    _gib(c.get("compiled_comm_bytes_per_step")),
                    "-" if comm_gap is None else f"{comm_gap:+.1f}%"]
        table.add_row(*row)
    console.print(table)
    for strategy, why in result.skipped.items():
        if strategy != "none":
            console.print(f"[dim]{strategy}: {escape(why)}[/]", highlight=False)
    if result.choice is not None:
        console.print(f"recommended: [bold]{result.choice.name}[/] - {escape(result.reason)}",
                      highlight=False, soft_wrap=True)


def render_max_seq(longest: dict[str, dict[str, int]], console) -> None:
    from rich.table import Table

    table = Table(title="longest sequence that fits", title_justify="left")
    table.add_column("strategy")
    table.add_column("estimated", justify="right")
    compiled = any("compiled" in v for v in longest.values())
    if compiled:
        table.add_column("compiled", justify="right")
    for name, figures in longest.items():
        row = [name, f"{figures['estimated']:,}"]
        if compiled:
            row.append(f"{figures['compiled']:,}")
        table.add_row(*row)
    console.print(table)
