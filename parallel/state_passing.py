"""state_passing: gated DeltaNet layers (kernels/gdn.py) with context parallelism.

Each device holds contiguous runs of the sequence: one, or two with load balancing
(chunks i and 2c-1-i of 2c, parallel/strategy.py; the attention layers of the same model
want it, and every layer kind stores the sequence alike). The delta rule over a run is
affine in the state it starts from: S_end = A S_0 + B (A [h, d_k, d_k], B [h, d_k, d_v]).
A first kernel pass finds both, without outputs (kernels/gdn.final_state): the state
widened to [d_k, d_k + d_v], started at [I | 0], with values read as [0 | v] (the state's
columns evolve independently), ends at [A | B]. Then each device

1. all-gathers every run's (A, B) over the sequence axes: f32, O(d_k (d_k + d_v)) per
   head, whatever the sequence length;
2. folds them in sequence order, S(m+1) = A_m S(m) + B_m from S(0) = 0 (c x runs small
   matmuls per head, redundantly on every device: nothing next to a run);
3. runs the kernel again over its runs, from the states S(its runs), for the outputs.

Outputs from the first pass instead (each is affine in S_0 too: o_t = S_0^T (A_t^T q_t)
+ o_t from zero, so [A_t^T q_t | o_t from zero] corrected by S(run)) would save the
second pass's chunk terms, but they are f32 and d_k + d_v wide, and their gradient too:
recipes/qwen3_next_like.yaml needed more memory per chip that way (benchmarks/RESULTS.md,
"A linear layer's own working set").

The backward: the kernel's custom VJP, and a custom VJP of steps 1-2 that all-gathers
the gradients of the runs' start states (d_k x d_v per run) and walks the fold backwards
on every device: fewer bytes than autodiff's transpose of the all-gather (a reduce-scatter
of every dA, dB, which XLA's TPU compiler lowers as an all-reduce, twice those again).

Why not a ppermute chain (device i waits for i-1's end state, then runs and sends on):
the runs would go one after another, c times the time. With the affine maps a chain
would only carry states, (c-1) x d_k d_v per head, but as c-1 dependent hops, each
waiting on the last; the all-gather is one collective of about twice those bytes (A
and B, d_k = d_v), and no device waits on another's fold. At Qwen3-Next's sizes (32
value heads of 128 x 128, one row, two runs per device, context 4, no tensor split) a
layer's step receives 24 MiB in the forward's gather and 12 MiB in the backward's,
whatever the sequence length (XLA's TPU compile for v5p:2x2x1 at 8K tokens: 36 MiB of
all-gather, no other collective).

Cost: the first pass, whose widened state does d_k + d_v columns' work (`extra_flops`).
Packed documents: a token at position 0 of its document gets g = -inf (the state is
zeroed before its update, kernels/gdn.reset_at_document_starts), so a run that starts a
document has A = 0 and nothing crosses a document boundary, on a device or between them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lctrain.kernels.gdn import (PRECISION, final_state, gated_delta_rule,
                                 reset_at_document_starts)
from lctrain.parallel.cost_model import (F32, TOKEN_IDS, AttentionFootprint, Dims,
                                         NotOnThisMesh, Traffic)
from lctrain.parallel.sharding import LOGICAL_TO_MESH
from lctrain.parallel.strategy import (HEADS_SPEC, TOKENS_SPEC, ContextStrategy,
                                      stored_chunk_tokens)
from lctrain.recipes.schema import Recipe, RecipeError

# The sequence's shards in sequence order (context major, ulysses minor).
SEQUENCE_AXES = LOGICAL_TO_MESH["sequence"]
GATES_SPEC = P(LOGICAL_TO_MESH["batch"], LOGICAL_TO_MESH["sequence"], "tensor")
# Runs per device the planner assumes (parallel.load_balance defaults to true).
PLANNED_RUNS = 2
CHUNK = 64


class StatePassing(ContextStrategy):
    name = "state_passing"
    simplicity = 6
    chunk = CHUNK

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        """Not a whole model's strategy: attention layers need another."""
        raise NotOnThisMesh("state_passing serves gated DeltaNet layers only")

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        """RecipeError unless each stored run holds the kernel - 1 tokens the conv of the
        run after it reads (parallel/linear_mix.py); no attention kernel runs."""
        kernel, run = recipe.model.linear_conv_kernel, stored_chunk_tokens(
            recipe, axis_sizes["context"])
        if kernel - 1 > run:
            raise RecipeError(
                f"recipe key 'model.linear_conv_kernel' = {kernel}: state_passing needs "
                f"kernel - 1 <= the {run} tokens of each stored chunk; use more tokens per "
                f"chip (data.seq_len / mesh.context) or a smaller kernel")

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """A linear layer's backward (dm.h value heads, dm.kv key heads, dm.d = d_k = d_v
        per tensor shard). Per token: q, k, v before and after the conv, and the conv's
        input with its halo (compute dtype), and their f32 gradients; the output gate z and
        the delta rule's output (compute dtype), and the gated norm's f32 input and
        gradient. Beside them the first pass's segment start states of the widened [d_k,
        d_k + d_v] state, about sqrt(chunks) of them."""
        tokens = dm.b * dm.s_l
        qkv, values = (2 * dm.kv + dm.h) * dm.d, dm.h * dm.d
        states = math.isqrt(max(1, dm.s_l // cls.chunk)) + 1
        working_set = (tokens * (qkv * (3 * dm.p + F32) + values * 2 * (dm.p + F32))
                       + states * dm.b * dm.h * dm.d * 2 * dm.d * F32)
        return AttentionFootprint(working_set, dm.s_l, dm.s_l, dm.h, dm.kv)

    @classmethod
    def kernel_residuals(cls, dm: Dims) -> float:
        """What the kernel keeps: its inputs (q, k, v as given, g and beta f32)."""
        return dm.b * dm.s_l * ((2 * dm.kv + dm.h) * dm.d * dm.p + 2 * dm.h * F32)

    def attend(self, q, k, v, positions, segment_ids, *, window=None):
        raise ValueError("state_passing serves linear (Gated DeltaNet) layers only, through "
                         "parallel/linear_mix.linear_mix; attention layers need another")

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        """dm.h: the layers' value heads per tensor shard; dm.d: d_k = d_v."""
        return {**state_passing_traffic(dm.b, dm.h, dm.d, dm.d, dm.c, PLANNED_RUNS, dm.layers,
                                        dm.attention_passes),
                **conv_halo_traffic(dm)}

    @classmethod
    def extra_flops(cls, dm: Dims) -> float:
        """The same dims as traffic: FLOPs per device and step beyond one device's."""
        return state_passing_extra_flops(dm.b, dm.h, dm.d, dm.d, dm.s_l, dm.c, PLANNED_RUNS,
                                         cls.chunk, dm.layers, dm.attention_passes)

    def delta_rule(self, q, k, v, g, beta, positions):
        """The gated delta rule of the stored batch, restarting at every document (kernels/
        gdn.py's shapes; positions [b, s]: each token's position in its document).
        Global-shape, mesh-sharded arrays, as `attend` takes them; out like v."""
        per_device = jax.shard_map(
            functools.partial(local_delta_rule, runs=2 if self.load_balance else 1,
                              chunk=self.chunk),
            mesh=self.mesh, in_specs=(HEADS_SPEC,) * 3 + (GATES_SPEC,) * 2 + (TOKENS_SPEC,),
            out_specs=HEADS_SPEC, check_vma=False)
        return per_device(q, k, v, g, beta, positions)


def local_delta_rule(q, k, v, g, beta, positions, runs, chunk):
    """One device's share: its `runs` runs of the sequence, from the states the runs
    before them leave (module docstring)."""
    g = reset_at_document_starts(g, positions)
    if jax.lax.axis_size(SEQUENCE_AXES) == 1:
        return gated_delta_rule(q, k, v, g, beta, chunk=chunk)[0]
    q, k, v, g, beta = (runs_as_rows(x, runs) for x in (q, k, v, g, beta))
    d_k, d_v = k.shape[-1], v.shape[-1]
    rows, _, heads, _ = v.shape
    identity = jnp.concatenate([jnp.eye(d_k), jnp.zeros((d_k, d_v))], axis=-1)
    maps = final_state(k, v, g, beta, chunk=chunk,
                       initial_state=jnp.broadcast_to(identity, (rows, heads, *identity.shape)))
    out, _ = gated_delta_rule(q, k, v, g, beta, chunk=chunk,
                              initial_state=_run_starts(maps, runs))
    return rows_as_runs(out, runs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _run_starts(maps, runs):
    """The state each of this device's runs starts from, [runs * b, h, d_k, d_v], from
    every run's [A | B] (maps: this device's, [runs * b, h, d_k, d_k + d_v])."""
    return _run_starts_fwd(maps, runs)[0]


def _run_starts_fwd(maps, runs):
    in_order = _gathered_in_sequence_order(maps, runs)
    d_k = maps.shape[2]

    def fold(start, run_map):
        end = jnp.einsum("bhij,bhjv->bhiv", run_map[..., :d_k], start, precision=PRECISION)
        return end + run_map[..., d_k:], start

    _, starts = jax.lax.scan(fold, jnp.zeros_like(in_order[0, ..., d_k:]), in_order)
    return _own_runs(starts, runs), (in_order[..., :d_k], starts)


def _run_starts_bwd(runs, residuals, d_own_starts):
    """The fold backwards from every run's start-state gradient: all-gathered (d_k x d_v
    per run, where autodiff would reduce-scatter d_k x (d_k + d_v), and XLA's TPU compiler
    turns that into an all-reduce of every run's); each device then keeps its own."""
    transitions, starts = residuals
    d_starts = _gathered_in_sequence_order(d_own_starts, runs)

    def unfold(d_next_start, run):
        transition, start, d_start = run
        d_map = jnp.concatenate([jnp.einsum("bhiv,bhjv->bhij", d_next_start, start,
                                            precision=PRECISION), d_next_start], axis=-1)
        d_start = d_start + jnp.einsum("bhij,bhiv->bhjv", transition, d_next_start,
                                       precision=PRECISION)
        return d_start, d_map

    _, d_maps = jax.lax.scan(unfold, jnp.zeros_like(starts[0]),
                             (transitions, starts, d_starts), reverse=True)
    return (_own_runs(d_maps, runs),)


_run_starts.defvjp(_run_starts_fwd, _run_starts_bwd)


def _gathered_in_sequence_order(x, runs):
    """Every device's per-run values x [runs * b, ...], as [devices * runs, b, ...] in
    the sequence's order of the runs."""
    size = jax.lax.axis_size(SEQUENCE_AXES)
    gathered = jax.lax.all_gather(x.reshape(runs, -1, *x.shape[1:]), SEQUENCE_AXES)
    return gathered.reshape(size * runs, *gathered.shape[2:])[
        _gathered_index_in_sequence_order(size, runs)]


def _own_runs(x, runs):
    """This device's runs' entries of x [devices * runs, b, ...] (sequence order), as
    [runs * b, ...]."""
    size, rank = jax.lax.axis_size(SEQUENCE_AXES), jax.lax.axis_index(SEQUENCE_AXES)
    return x[jnp.stack([rank, 2 * size - 1 - rank])[:runs]].reshape(-1, *x.shape[2:])


def _gathered_index_in_sequence_order(size, runs):
    """Index into the gathered runs (device major, then run) of the sequence's m-th run:
    device m's only run, or with two runs per device (load balancing) device m's first
    for m < size and device 2 size - 1 - m's second after."""
    m = np.arange(size * runs)
    return m if runs == 1 else np.where(m < size, 2 * m, 2 * (2 * size - 1 - m) + 1)


def runs_as_rows(x, runs):
    """[b, runs * n, ...] -> [runs * b, n, ...], run major."""
    b, tokens = x.shape[:2]
    x = x.reshape(b, runs, tokens // runs, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0).reshape(runs * b, tokens // runs, *x.shape[3:])


def rows_as_runs(x, runs):
    """The inverse of runs_as_rows."""
    rows, tokens = x.shape[:2]
    x = jnp.moveaxis(x.reshape(runs, rows // runs, tokens, *x.shape[2:]), 0, 1)
    return x.reshape(rows // runs, runs * tokens, *x.shape[3:])


def state_passing_traffic(b, heads, d_k, d_v, c, runs, layers, passes) -> Traffic:
    """Bytes one device receives per micro-batch: each forward (`passes`: 2 when remat
    recomputes it) all-gathers the other c-1 devices' f32 [A | B] of each of their `runs`
    runs; the backward all-gathers their runs' start-state gradients. No sequence length
    in it."""
    per_run = b * heads * d_k * F32
    return {"strategy_state_maps": ("all-gather",
                                    passes * layers * (c - 1) * runs * per_run * (d_k + d_v)),
            "strategy_state_grads": ("all-gather", layers * (c - 1) * runs * per_run * d_v)}


def conv_halo_traffic(dm: Dims) -> Traffic:
    """The causal conv's sends before the delta rule (parallel/linear_mix.py): per layer and
    forward pass the kernel-1 tokens of q, k and v before each of a device's runs, and in
    the backward their gradients back. Their sequence indices and segment ids go too, the
    same in every layer: XLA sends them once per step, or per layer and forward pass where
    the layers' kinds are switched, as it does halo's (parallel/halo.py)."""
    width = dm.conv_kernel - 1
    if width <= 0 or dm.c == 1:
        return {}
    tokens = dm.b * PLANNED_RUNS * width
    features = (2 * dm.kv + dm.h) * dm.d * dm.p
    id_sends = dm.layers * dm.attention_passes if dm.kinds_switched else 1
    return {"strategy_conv_halo": ("collective-permute", tokens * (
        dm.layers * (dm.attention_passes + 1) * features + id_sends * TOKEN_IDS))}


def state_passing_extra_flops(b, heads, d_k, d_v, tokens, c, runs, chunk, layers,
                              passes) -> float:
    """FLOPs per device and step the split adds to its `tokens` tokens' kernel work: the
    first pass, the widened state's run without outputs (per token and head: the chunk's
    k k^T products 2 C d_k, its solve for d_k + d_v widened values and d_k state columns
    C (2 d_k + d_v), and the state's read and write 4 d_k (d_k + d_v)), and the fold of
    all c x runs maps (2 d_k^2 d_v each). The second pass is the kernel one device runs.
    The kernel's backward counts as four forwards: it redoes each segment's forward for
    its chunk states, each chunk's again under jax.vjp, and the vjp's products cost about
    two more."""
    per_token = 2 * chunk * d_k + chunk * (2 * d_k + d_v) + 4 * d_k * (d_k + d_v)
    forward = b * heads * (tokens * per_token + c * runs * 2 * d_k * d_k * d_v)
    return (passes + 4) * layers * forward
