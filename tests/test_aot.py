"""Ahead-of-time compiles for a real TPU topology (parallel/aot.py): the compiled train
step of every context-parallel strategy checked against the traffic and memory its code
implies (slow, needs libtpu; the HLO collective counter itself: tests/test_hlo.py).
"""

from __future__ import annotations

import functools
import math

import pytest

from lctrain.parallel import aot
from lctrain.parallel.chips import compile_options_for
from lctrain.parallel.hlo_kernels import relayouts_next_to_kernels
from lctrain.recipes import load_recipe
from lctrain.trainer.state import build
from helpers import one_worker
from tpu_aot import needs_libtpu


def test_hbm_bytes_subtracts_the_aliased_state_once():
    stats = aot.CompiledStats(argument_bytes=100, output_bytes=90, temp_bytes=50,
                              alias_bytes=80, host_temp_bytes=0, host_argument_bytes=0,
                              generated_code_bytes=7, collective_bytes={})
    assert stats.hbm_bytes == 160


def test_missing_libtpu_says_what_to_install(without_libtpu):
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[tpu\]'"):
        aot.topology_devices("v5p:2x2x1")


# ------------------------------------------------- compiled train steps ----
#
# The tiny recipe, its shape pinned here (2 layers, 8 query / 2 KV heads of head_dim 16),
# in bfloat16 on TPU v5p 2x2x1 with mesh.context = 4 and one sequence of S tokens: each
# chip holds S/4 of it. Remat is the default 'full': each layer's forward runs twice.
# The formulas are for the collectives inside the strategy's shard_map (jax op_name has
# "shard_map"): the gradient all-reduce and what XLA's partitioner adds around the model
# (weight all-gathers at this small width) are left out.

TOPOLOGY, C, S = "v5p:2x2x1", 4, 4096
MODEL_SETS = ("model.preset=tiny", "model.layers=2", "model.d_model=128", "model.n_heads=8",
              "model.n_kv_heads=2", "model.d_ff=384", "model.dtype=bfloat16",
              "attention.impl=xla")  # the figures below are the XLA kernel's
MODEL = load_recipe("tiny", list(MODEL_SETS)).model
LAYERS, HEADS, KV_HEADS, HEAD_DIM = MODEL.layers, MODEL.n_heads, MODEL.n_kv_heads, MODEL.head_dim
BF16, INT32 = 2, 4

shares_compiles = one_worker("test_aot_cases")  # the tests that share a compiled case


def compiled(strategy: str, seq_len: int = S, extra: tuple[str, ...] = ()) -> aot.CompiledStats:
    return _compiled(strategy, seq_len, extra)  # one cache key per case, however it is called


@functools.cache
def _compiled(strategy: str, seq_len: int, extra: tuple[str, ...]) -> aot.CompiledStats:
    overrides = [*MODEL_SETS, f"parallel.strategy={strategy}", f"mesh.context={C}",
                 "mesh.data=1", f"data.seq_len={seq_len}", "data.batch_size=1", *extra]
    if strategy == "usp":
        overrides.append("parallel.ulysses=2")
    recipe = load_recipe("tiny", overrides)
    stats = aot.compiled_stats(build.compile_train_step(recipe, aot.topology_devices(TOPOLOGY)))
    print(f"\n{strategy} s={seq_len}: temp {stats.temp_bytes:,} hbm {stats.hbm_bytes:,} "
          f"collectives {stats.collective_bytes}")
    assert stats.unknown_trip_counts == 0
    return stats


def kv_bytes(tokens: int, heads: int = KV_HEADS) -> int:
    """One layer's K (or V) in bf16 for `tokens` tokens of `heads` heads."""
    return tokens * heads * HEAD_DIM * BF16


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_ring_rotations_match_the_code():
    """parallel/ring.py, per layer, with remat 'full' (the layer's forward runs twice):

    forward (and its recomputation in backward): c-1 steps send K, V and the stacked
      positions / segment ids on (the last chunk to arrive goes nowhere);
    backward: c-1 sends of K, V, ids, and c-1 of the f32 dK/dV sum (it starts one chip on
      and ends home).

    Every ring step is tied to what it carries, so nothing is hoisted out of the layer
    scan. With kv = K bytes of one chip's chunk, tok = its int32 ids:
      L (c-1) (2kv + 2tok)         forward, per layer
      L (c-1) (2kv + 2tok)         recomputed forward
      L (c-1) (2kv + 4kv + 2tok)   backward (dK, dV in f32: twice kv each)
    """
    chunk = S // C
    kv, tok = kv_bytes(chunk), chunk * INT32
    expected = LAYERS * (C - 1) * (10 * kv + 6 * tok)
    ring = compiled("ring").shard_map_collective_bytes
    assert ring["collective-permute"] == pytest.approx(expected, rel=0.05)
    assert ring["all-gather"] == ring["all-to-all"] == ring["all-reduce"] == 0


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_all_gather_traffic_matches_the_code():
    """parallel/all_gather.py: every chip receives (c-1)/c of the whole sequence's K and V
    per layer, in the forward and again in its recomputation (remat 'full'); positions and
    segment ids once per recomputed layer plus once (hoisted) for the forward. Autodiff
    turns the gathers into reduce-scatters of dK, dV (bf16): (c-1) chunk-sized partial
    sums arrive per tensor per layer."""
    share = (C - 1) / C
    gathers = 2 * LAYERS * 2 * kv_bytes(S) * share + (1 + LAYERS) * 2 * S * INT32 * share
    scatters = LAYERS * 2 * kv_bytes(S // C) * (C - 1)
    all_gather = compiled("all_gather").shard_map_collective_bytes
    assert all_gather["all-gather"] == pytest.approx(gathers, rel=0.05)
    assert all_gather["reduce-scatter"] == pytest.approx(scatters, rel=0.05)
    assert all_gather["collective-permute"] == all_gather["all-reduce"] == 0


@pytest.mark.slow
@needs_libtpu
def test_ulysses_and_usp_traffic_matches_the_code():
    """ulysses: per layer 4 all-to-alls in the forward (q, k, v, out), again in the
    recomputation, and 4 in the backward (dout, dq, dk, dv), each chip keeping 1/n of
    each. The KV heads are repeated (2 -> 4) so that the 4 chips can split them.
    usp (ulysses 2 x ring 2): the same all-to-alls over 2 chips with KV heads not repeated,
    and the ring of test_ring_rotations_match_the_code over 2 groups, each chunk holding
    S/2 tokens of half the heads."""
    q_bytes = kv_bytes(S // C, HEADS)                       # one chip's q (and out) chunk
    kv_repeated = kv_bytes(S // C, math.lcm(KV_HEADS, C))   # KV heads repeated for c
    per_layer = 3 * (2 * q_bytes + 2 * kv_repeated)        # fwd, recomputed fwd, bwd
    ulysses = compiled("ulysses").shard_map_collective_bytes
    assert ulysses["all-to-all"] == pytest.approx(LAYERS * per_layer * (C - 1) / C, rel=0.05)
    # positions and segment ids: gathered per recomputed layer, and once (hoisted) for
    # the forward.
    ids = (1 + LAYERS) * 2 * S * INT32
    assert ulysses["all-gather"] == pytest.approx(ids * (C - 1) / C, rel=0.05)
    assert ulysses["collective-permute"] == ulysses["reduce-scatter"] == 0

    u, ring = 2, C // 2
    per_layer = 3 * (2 * q_bytes + 2 * kv_bytes(S // C))
    usp = compiled("usp").shard_map_collective_bytes
    assert usp["all-to-all"] == pytest.approx(LAYERS * per_layer * (u - 1) / u, rel=0.05)
    assert usp["all-gather"] == pytest.approx(ids // ring * (u - 1) / u, rel=0.05)
    chunk = S // ring                                      # tokens per ring step
    kv = kv_bytes(chunk, KV_HEADS // u)
    tok = chunk * INT32
    permutes = LAYERS * (ring - 1) * (10 * kv + 6 * tok)
    assert usp["collective-permute"] == pytest.approx(permutes, rel=0.05)


@pytest.mark.slow
@needs_libtpu
@functools.cache
def temp_bytes_at_fixed_chunk(strategy: str, topology: str) -> int:
    """Temporaries of the step with every chip of `topology` in the context axis, each
    holding CHUNK tokens; MHA (8 KV heads) so that K/V weigh as much as the activations."""
    chips = math.prod(int(n) for n in topology.split(":")[1].split("x"))
    recipe = load_recipe("tiny", [*MODEL_SETS, "model.n_kv_heads=8", f"parallel.strategy={strategy}",
                                "mesh.data=1", "mesh.context=-1", "data.batch_size=1",
                                f"data.seq_len={CHUNK * chips}"])
    stats = aot.compiled_stats(build.compile_train_step(recipe, aot.topology_devices(topology)))
    print(f"\n{strategy} {topology} s={CHUNK * chips}: temp {stats.temp_bytes:,}")
    return stats.temp_bytes


CHUNK = 1024


@pytest.mark.slow
@needs_libtpu
def test_ring_memory_follows_the_chunk_all_gather_the_sequence():
    """Twice the chips, twice the sequence, the same chunk per chip: ring holds only
    chunk-sized K/V blocks in flight, so its temporaries barely move (chunks of 1024:
    jax 0.10: 48.5 -> 52.1 MB from c=4 to c=8; jax 0.12: 49.8 -> 54.3); all_gather holds
    the whole sequence's K/V and their f32 gradients, so its temporaries grow with it
    (0.10: 30.5 -> 64.8 MB; 0.12: 44.0 -> 69.4), by well over the added tokens' K/V and f32
    gradients in one layer (6.3 MB). (Chunks of 1024, not 2048: the same comparison at a
    smaller compile.)

    (Before parallel/ring.py tied positions to K/V, XLA hoisted every ring step's
    position-only work out of the layer loop: 155 MB at c=4 for the GQA model.)"""
    ring = [temp_bytes_at_fixed_chunk("ring", t) for t in ("v5p:2x2x1", "v5p:2x2x2")]
    gather = [temp_bytes_at_fixed_chunk("all_gather", t) for t in ("v5p:2x2x1", "v5p:2x2x2")]
    added_tokens = 4 * CHUNK
    kv_and_grads = added_tokens * 2 * 8 * HEAD_DIM * (BF16 + 4)  # K, V (MHA) + f32 grads
    assert ring[1] < 1.4 * ring[0]
    assert gather[1] - gather[0] > 2 * kv_and_grads
    assert gather[1] - gather[0] > 3 * (ring[1] - ring[0])


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_all_gather_memory_grows_linearly_with_the_sequence():
    """Everything all_gather holds grows linearly with s (K/V gathered to s, activations
    s/c), so doubling s may at most about double its temporaries. (It quadrupled while
    XLA hoisted every block's mask pred[s/c/bq, s/bkv, b, hkv, g, bq, bkv] out of the layer
    loop; kernels/xla.py now ties each mask to its block's keys.)"""
    assert compiled("all_gather", 2 * S).temp_bytes < 2.2 * compiled("all_gather", S).temp_bytes


@shares_compiles
@pytest.mark.slow
@needs_libtpu
def test_chunked_mlp_gathers_its_weights_once_per_layer():
    """remat.mlp_chunk_tokens = S/4: four chunks per MLP. Its weights are gathered before
    the chunk loop, so the step all-gathers what the unchunked one does (inside the loop
    XLA gathered them, and all-reduced their gradient, once per chunk); only the MLP
    gradient's all-reduce grows, from bf16 to f32. One weight gathered once more would
    add a whole weight's share; the all-gathers may differ by less than half of one (libtpu
    0.0.50 gathers 12,288 B less of something else in the chunked step, 0.0.42 the same)."""
    plain = compiled("ring")
    chunked = compiled("ring", extra=(f"remat.mlp_chunk_tokens={S // 4}",))
    one_weight_gathered = MODEL.d_model * MODEL.d_ff * BF16 * (C - 1) / C
    assert abs(chunked.collective_bytes["all-gather"] - plain.collective_bytes["all-gather"]
               ) < one_weight_gathered / 2
    mlp_elements = LAYERS * 3 * MODEL.d_model * MODEL.d_ff
    grown = chunked.collective_bytes["all-reduce"] - plain.collective_bytes["all-reduce"]
    assert grown == pytest.approx(mlp_elements * (4 - BF16) * 2 * (C - 1) / C, rel=0.01)


KERNEL_NAMES = {"pallas": ("lctrain_flash_forward", "lctrain_flash_backward"),
                "splash": ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv")}


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("topology, strategy, impl", [
    # A covering set, not the product (CI time: one compile each): every strategy, both
    # kernels, both topologies, and each place a relayout is allowed (splash's forward,
    # Ulysses' all-to-all) with each kernel. The kernels are called by the same strategy
    # code, whichever kernel it is. Ring code with splash is usp's ring over its 2 groups
    # (parallel/usp.py calls parallel/ring.ring_attention), so no v5p ring x splash case.
    ("v5p:2x2x1", "all_gather", "splash"), ("v5p:2x2x1", "ulysses", "pallas"),
    ("v5p:2x2x1", "usp", "splash"),
    # On tpu7x (two devices per chip) ring, which calls our kernel per ring step.
    ("tpu7x:2x2x1", "ring", "pallas")])
def test_train_step_runs_the_kernel_through_mosaic(topology, strategy, impl):
    """The whole train step with attention.impl=pallas (ours) or splash, compiled for the
    TPU with every device in the context axis (4 v5p chips; 8 devices on tpu7x, two per
    chip): every strategy's program calls the forward, dq and dk/dv kernels as Mosaic
    custom calls (not an XLA fallback), and no call has a relayout copy or transpose of
    a K-sized tensor or larger beside it (issue 18: ring and Ulysses keep their tensors
    in the kernels' layout, converted once per layer), but for the two kinds below."""
    # Llama's head dim: a head dim of 16 fills an eighth of the 128 lanes of a TPU tile,
    # and XLA lays such tensors out otherwise (it relayouts q for all_gather's kernel).
    overrides = [*MODEL_SETS, "model.head_dim=128", f"parallel.strategy={strategy}",
                 "mesh.context=-1", "mesh.data=1", "data.seq_len=2048", "data.batch_size=1",
                 f"attention.impl={impl}"]
    if strategy == "usp":
        overrides.append("parallel.ulysses=2")
    devices = aot.topology_devices(topology)
    text = build.compile_train_step(load_recipe("tiny", overrides), devices).as_text()
    mosaic_calls = [line for line in text.splitlines()
                    if 'custom_call_target="tpu_custom_call"' in line]
    for kernel in KERNEL_NAMES[impl]:
        assert any(kernel in line for line in mosaic_calls), kernel
    local_kv = kv_bytes(2048 // len(devices)) * 128 // HEAD_DIM
    found = relayouts_next_to_kernels(text, KERNEL_NAMES[impl], local_kv)
    # Splash's forward writes its logsumexp 128 lanes wide, f32; XLA copies out the lane
    # kept (docs/kernels.md). Ulysses' all-to-all delivers sequence chunks major; one copy per
    # layer interleaves them per head (or back, before the all-to-all home).
    expected = [r for r in found if r.at_all_to_all and strategy in ("ulysses", "usp")
                or r.kernel.startswith("splash_mha_fwd") and r.side == "result"
                and r.shape.startswith("f32")]
    assert [r for r in found if r not in expected] == []


@needs_libtpu
def test_a_single_v5e_chip_compiles_with_the_chips_measured_kernel():
    """libtpu refuses 'v5e:1x1' with its default host of 2x2 chips; lctrain asks for a host
    of exactly that shape. The step compiles for it with our Pallas kernel (auto on a
    v5e: kernels/tiles.py) and the compiler's HBM limit lowered (libtpu takes the option)."""
    devices = aot.topology_devices("v5e:1x1")
    assert len(devices) == 1 and devices[0].device_kind == "TPU v5 lite"
    # the compiler's HBM check leaves room to load the program: 15.75 GiB less 256 MiB
    assert compile_options_for(devices[0]) == {"xla_tpu_max_hbm_size_mib": "15872"}
    recipe = load_recipe("tiny", ["model.dtype=bfloat16", "mesh.data=1", "data.batch_size=1",
                                  "data.seq_len=2048"])
    run = build.build_run(recipe, devices)
    assert "tpu_custom_call" in run.train_step.as_text()
    # what a run reports is XLA's peak, which libtpu checks against HBM, not the buffers'
    # sum (their temporaries are never all alive together; a small program's peak also
    # holds the runtime's own, so here it is the larger of the two)
    stats = aot.memory_stats(run.train_step)
    assert stats.peak_bytes == run.train_step.memory_analysis().peak_memory_in_bytes
    assert stats.peak_bytes != stats.hbm_bytes
    assert build.compiled_need("none", run.train_step, "tpu").hbm_bytes == stats.peak_bytes
