"""What one device receives over the interconnect per step, by source and collective kind.

Communication, bytes one device RECEIVES per step (the convention of parallel/aot.py):
  ZeRO-3 weights   every layer's matrices are all-gathered in the compute dtype twice
                   per step (forward; backward, where a rematerialised forward reuses
                   them); the norm scales in f32 (2 + 4 gathers per layer).
  gradients        XLA all-reduces each layer's full gradient in the compute dtype over G
                   and keeps its shard (it does not emit a reduce-scatter): 2(G-1)/G x.
  loss head        with the loss chunked (trainer/model/loss.py) the output weights are
                   gathered in each chunk's forward and again in its recomputation, and
                   their gradient is all-reduced once per chunk in the compute dtype
                   (unchunked: once, f32 but for a head past HEAD_GRADIENT_F32_LIMIT):
                   n_chunks x the head, which at long context outweighs the strategy's
                   own traffic.
  embedding        token ids all-gathered over Z (the looked-up rows are pinned to their
                   tokens' devices, so no reshuffle follows); backward: the f32 rows
                   sent to the width shards, or the f32 table all-reduced, the smaller.
  strategy         the strategy's cost model (its `traffic`, parallel/cost_model.py):
                   all_gather: K, V (+ int32 positions, segment ids) gathered per layer
                   in the forward and in each recomputation of it, dK, dV reduce-scattered
                   once; ulysses: 4 all-to-alls (q, k, v, out) per forward pass, 4 in the
                   backward (dout, dq, dk, dv), KV heads repeated up to the degree; ring:
                   c sends of K, V, positions, segment ids per forward pass, c sends of
                   K, V, f32 dK, dV, positions, segment ids in the backward; usp: the
                   Ulysses traffic over its degree plus the ring over the rest.
  The first forward's position rotations / gathers do not depend on the layer: XLA hoists
  them out of the layer loop (once per step, not per layer).

Across slices (mesh.dcn_data, mesh.dcn_fsdp): the shared terms' all-reduces run over G,
whose data x fsdp part spans D_G = dcn_data x dcn_fsdp slices, their gathers and
all-to-alls over Z, which spans D_Z = dcn_fsdp; the context axes stay inside a slice, so
the strategy's own traffic never crosses. Counted for the bandwidth-optimal hierarchical
collective (in-slice reduce-scatter, one DCN collective per in-slice position on its
1/(n/D) shard, in-slice all-gather), the DCN part of a collective's bytes over n devices
in D slices is (D-1)/(n-1) for all-gather, reduce-scatter and all-reduce, and
n(D-1)/(D(n-1)) for an all-to-all (the blocks bound for other slices). Each source's DCN
part is its own entry, `<source>:dcn`. XLA sends some gradients across unscattered (the
tiny model's attention projections), so the compiled DCN bytes exceed this floor
(benchmarks/RESULTS.md, "What plan shows at scale, and across slices").
"""

from __future__ import annotations

from lctrain.parallel.cost_model import F32, INT32, Dims, Traffic
from lctrain.parallel.planner.shapes import Weights, loss_chunks
from lctrain.recipes.schema import Recipe

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# See the loss-head gradient in traffic(): XLA's choice of all-reduce dtype (f32 below,
# the compute dtype above), between the two sizes it was observed at.
HEAD_GRADIENT_F32_LIMIT = 2**30

# The suffix of a traffic source's part that crosses slices (timed at DCN bandwidth).
DCN = ":dcn"


def traffic(recipe: Recipe, dm: Dims, w: Weights, own: Traffic) -> Traffic:
    """Bytes one device receives per step, by source: the terms every strategy shares,
    then the strategy's own (`own`, per micro-batch: its cost model's traffic)."""
    L, p = dm.layers, dm.p
    n_chunks = loss_chunks(recipe, dm.c)[0]
    zf = (dm.z - 1) / dm.z
    gf = 2 * (dm.g - 1) / dm.g
    detail: Traffic = {}
    detail["zero3_weights"] = ("all-gather", 2 * L * w.layer_gathered * p * zf
                               + 6 * L * dm.e * F32 * zf)
    detail["gradients"] = ("all-reduce", L * (w.layer_gathered * p
                                              + w.mlp_gathered * (F32 - p)) * gf
                           + L * w.layer_norms * dm.e * F32 * gf)
    # The output weights are gathered for each chunk's forward and again for its
    # recomputation in backward. trainer/model/loss.py all-reduces each chunk's gradient in the
    # compute dtype; unchunked, XLA all-reduces it in f32, or for a head whose f32
    # gradient passes HEAD_GRADIENT_F32_LIMIT in the compute dtype (observed: f32 for
    # 1024 x 32768, bf16 for Llama 3.1 8B's 4096 x 128256).
    detail["loss_head_weights"] = ("all-gather", 2 * n_chunks * w.head * p * zf)
    head_grad_bytes = p if n_chunks > 1 or w.head * F32 > HEAD_GRADIENT_F32_LIMIT else F32
    detail["loss_head_gradient"] = ("all-reduce", (n_chunks * w.head * head_grad_bytes
                                                   + dm.e * F32) * gf)
    # The embedding's backward: XLA either sends the f32 cotangent of the looked-up rows
    # back to the width shards (all-to-all) or all-reduces the full f32 table gradient;
    # it picks the smaller (the table for a small vocabulary).
    table = ("all-reduce", w.embedding * F32 * gf)
    rows_back = ("all-to-all", dm.step_tokens * dm.e * F32 * zf)
    detail["embedding_gradient"] = min(table, rows_back, key=lambda kb: kb[1])
    detail["token_ids"] = ("all-gather", dm.step_tokens * dm.z * (INT32 + 1) * zf)
    detail = split_dcn(detail, dm, recipe.mesh.dcn_data, recipe.mesh.dcn_fsdp)
    detail.update(own)
    # With gradient accumulation every micro-batch repeats all of it (the sharded
    # gradient accumulator is reduced into per micro-batch too).
    return {source: (kind, nbytes * dm.accum) for source, (kind, nbytes) in detail.items()}


def split_dcn(detail: Traffic, dm: Dims, dcn_data: int, dcn_fsdp: int) -> Traffic:
    """The shared terms with each one's slice-crossing part split off as `<source>:dcn`
    (see the module docstring): all-reduces over G, everything else over Z."""
    split: Traffic = {}
    for source, (kind, nbytes) in detail.items():
        n, slices = (dm.g, dcn_data * dcn_fsdp) if kind == "all-reduce" else (dm.z, dcn_fsdp)
        share = dcn_share(kind, n, slices)
        split[source] = (kind, nbytes * (1 - share))
        if share:
            split[source + DCN] = (kind, nbytes * share)
    return split


def dcn_share(kind: str, n: int, slices: int) -> float:
    """Share of a hierarchical collective's bytes (n devices over `slices` slices) that
    crosses slices."""
    if slices == 1:
        return 0.0
    if kind == "all-to-all":
        return n * (slices - 1) / (slices * (n - 1))
    return (slices - 1) / (n - 1)


def dcn_bytes(detail_bytes: dict[str, float]) -> float:
    """The bytes that cross slices, from a plan's bytes by source."""
    return sum(nbytes for source, nbytes in detail_bytes.items() if source.endswith(DCN))


def by_kind(detail: Traffic) -> dict[str, float]:
    comm = dict.fromkeys(KINDS, 0.0)
    for kind, nbytes in detail.values():
        comm[kind] += nbytes
    return comm
