"""The planner (parallel/planner/): its analytic figures against hand-computed ones
(fast), the --max-seq search (fast), and its accuracy against XLA's own per-chip figures
for a real TPU topology (slow, needs libtpu). The `lctrain plan` command itself:
tests/test_plan_command.py."""

from __future__ import annotations

import functools
import os

import pytest

from helpers import TINY_MODEL, tiny_recipe
from lctrain.parallel import planner
from lctrain.parallel.auto import choose_strategy
from lctrain.parallel.chips import CHIPS, gigabytes
from lctrain.recipes import load_recipe
from tpu_aot import needs_libtpu

V5P = CHIPS["v5p"]
CONTEXT4 = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
# helpers.TINY_MODEL, one sequence of 4096 tokens over 4 context-parallel chips.
TINY = (*TINY_MODEL, "data.batch_size=1", "mesh.data=1", "mesh.context=4",
        "parallel.strategy=all_gather")
tiny = functools.partial(tiny_recipe, TINY)


# ------------------------------------------------------------ parameters ----

def test_state_and_gradient_bytes_by_hand():
    # per layer: 2 norms (128) + wq, wo (128*8*16) + wk, wv (128*2*16) + 3 MLP (128*384)
    layer = 2 * 128 + 2 * 16384 + 2 * 4096 + 3 * 49152
    total = 2 * layer + 2 * 128 * 128 + 128          # + embedding, unembedding, final norm
    assert planner.count_parameters(tiny().model) == total == 410_240
    # Width 128 splits 4 ways (context), so every tensor is sharded 4 ways.
    estimate = planner.estimate(tiny(), CONTEXT4, V5P, "all_gather")
    assert estimate.memory["state"] == 12 * total // 4        # f32 params + AdamW mu, nu
    # f32 gradients (how many buffers of them: calibrated)
    assert estimate.memory["gradients"] == pytest.approx(
        planner.CALIBRATION["gradient_copies"] * 4 * total / 4)
    # bf16 copies of the layer stacks (how many: calibrated on compiled programs)
    assert estimate.memory["weight_copies"] == pytest.approx(
        planner.CALIBRATION["weight_copies"] * 2 * 2 * layer / 4)
    # ... fewer where each layer's weights are cast inside the layer loop
    recast = planner.estimate(tiny("remat.recast_weights=true"), CONTEXT4, V5P, "all_gather")
    assert recast.memory["weight_copies"] == pytest.approx(
        (planner.CALIBRATION["weight_copies"] - planner.CALIBRATION["recast_weight_copies"])
        * 2 * 2 * layer / 4)


def test_dimensions_the_mesh_does_not_divide_stay_whole():
    # Width 96 over 64 context chips: not divisible, so nothing is sharded.
    recipe = tiny("model.d_model=96", "model.n_heads=6", "model.n_kv_heads=2")
    sizes = {"data": 1, "fsdp": 1, "context": 64, "tensor": 1}
    estimate = planner.estimate(recipe, sizes, V5P, "ring")
    assert estimate.memory["state"] == 12 * planner.count_parameters(recipe.model)


def test_every_registered_strategy_has_a_cost_model():
    """The planner asks each strategy class for its own terms: a strategy in the registry
    without them would fail here, not in a user's plan."""
    from lctrain.parallel import STRATEGIES
    for name, strategy in STRATEGIES.items():
        sizes = CONTEXT4 if name != "none" else {**CONTEXT4, "context": 1}
        estimate = planner.estimate(tiny(), sizes, V5P, name, 2)
        assert estimate.memory["attention"] > 0
        dims = planner.shapes.dims(tiny(), sizes, name, 2)
        own = set(strategy.traffic(dims))
        assert own <= set(estimate.comm_detail) and all(s.startswith("strategy_") for s in own)
        assert (estimate.ring_hidden is None) == (strategy.ring_timing(dims, V5P) is None)


# --------------------------------------------------------- communication ----

def test_ring_and_all_gather_traffic_by_hand():
    """tests/test_aot.py's formulas (checked there against the compiled HLO): with kv = one
    chip's chunk of K in bf16 and tok = its int32 positions."""
    L, C, S, KV, D = 2, 4, 4096, 2, 16
    kv, tok = S // C * KV * D * 2, S // C * 4
    ring = planner.estimate(tiny(), CONTEXT4, V5P, "ring").comm_detail["strategy_ring"]
    assert ring == L * (C - 1) * (10 * kv + 6 * tok)
    gather = planner.estimate(tiny(), CONTEXT4, V5P, "all_gather").comm_detail
    share = (C - 1) / C
    assert gather["strategy_kv"] == pytest.approx(
        (2 * L * 2 * S * KV * D * 2 + (1 + L) * 2 * S * 4) * share)
    assert gather["strategy_dkv"] == L * 2 * kv * (C - 1)


def test_zero3_weight_and_gradient_traffic_by_hand():
    """Each layer's matrices are gathered (bf16) twice per step over the 4 chips and their
    gradient all-reduced in bf16; the loss head's weights once per loss chunk and
    recomputation, its gradient all-reduced once per chunk."""
    matrices = 2 * 16384 + 2 * 4096 + 3 * 49152
    detail = planner.estimate(tiny(), CONTEXT4, V5P, "ring").comm_detail
    assert detail["zero3_weights"] == pytest.approx(
        2 * 2 * matrices * 2 * 3 / 4 + 6 * 2 * 128 * 4 * 3 / 4)
    assert detail["gradients"] == pytest.approx((2 * matrices * 2 + 2 * 2 * 128 * 4) * 1.5)
    chunks, _ = planner.loss_chunks(tiny(), 4)
    assert chunks == 1                                  # 4096 tokens: one chunk
    assert detail["loss_head_weights"] == pytest.approx(2 * 128 * 128 * 2 * 3 / 4)


def test_ulysses_traffic_grows_with_the_degree_but_not_with_context_at_fixed_chunk():
    """All-to-all bytes per device depend on the chunk per chip, not on the sequence."""
    small = planner.estimate(tiny(), CONTEXT4, V5P, "ulysses").comm_detail
    sizes8 = {**CONTEXT4, "context": 8}
    large = planner.estimate(tiny("data.seq_len=8192", "mesh.context=8"), sizes8, V5P,
                             "ulysses").comm_detail
    # Same 1024-token chunk; the degree goes 4 -> 8 (7/8 vs 3/4 sent), KV heads are
    # repeated to 4 and to 8.
    q = 1024 * 8 * 16 * 2
    assert small["strategy_all_to_all"] == pytest.approx(2 * 3 * (2 * q + 2 * 1024 * 4 * 16 * 2)
                                                         * 3 / 4)
    assert large["strategy_all_to_all"] == pytest.approx(2 * 3 * (2 * q + 2 * q) * 7 / 8)


def test_all_gather_memory_grows_with_the_sequence_ring_memory_with_the_chunk():
    """Twice the sequence on twice the chips: the same chunk per chip."""
    sizes8 = {**CONTEXT4, "context": 8}
    for strategy, grows in (("all_gather", True), ("ring", False)):
        four = planner.estimate(tiny(), CONTEXT4, V5P, strategy).memory["attention"]
        eight = planner.estimate(tiny("data.seq_len=8192", "mesh.context=8"), sizes8, V5P,
                                 strategy).memory["attention"]
        assert (eight > four) is grows and eight >= four


def test_remat_policies_order_saved_activations():
    saved = {policy: planner.estimate(tiny(f"remat.policy={policy}"), CONTEXT4, V5P,
                                      "ring").memory["activations"]
             for policy in ("full", "minimal", "save_all")}
    # layers x tokens x width x bf16, in as many copies as XLA keeps of the scan's stack
    assert saved["full"] == pytest.approx(
        planner.CALIBRATION["stacked_input_copies"] * 2 * 1024 * 128 * 2)
    assert saved["full"] < saved["minimal"] < saved["save_all"]


def test_offloaded_tensors_are_host_memory():
    recipe = tiny("remat.policy=custom", "remat.tensors={mlpwi: offload, context: device}")
    estimate = planner.estimate(recipe, CONTEXT4, V5P, "ring")
    assert estimate.host["offloaded_activations"] == 2 * 1024 * 2 * 384 * 2
    # the layer input (the scan carry) and the kept `context`, per layer and token
    assert estimate.memory["activations"] == pytest.approx(
        2 * 1024 * (planner.CALIBRATION["stacked_input_copies"] * 128
                    + planner.CALIBRATION["saved_copies"] * 8 * 16) * 2)


def test_candidates_follow_the_heads():
    names = [p.name for p in planner.plan(tiny(), V5P, CONTEXT4).plans]
    assert names == ["all_gather", "ulysses", "usp(u=2)", "ring"]
    three_heads = tiny("model.n_heads=3", "model.n_kv_heads=1", "model.d_model=96")
    result = planner.plan(three_heads, V5P, CONTEXT4)
    assert [p.name for p in result.plans] == ["all_gather", "ring"]
    assert "ulysses" in result.skipped and "usp" in result.skipped
    one = planner.plan(tiny("mesh.context=1", "parallel.strategy=none"), V5P,
                       {**CONTEXT4, "context": 1})
    assert [p.name for p in one.plans] == ["none"]


def test_splash_leaves_out_strategies_its_block_map_cannot_serve():
    """1M tokens on 4 chips: splash's map fits ring's 256K x 256K steps (and usp's 512K x
    512K do not); all_gather (256K x 1M) and ulysses (1M x 1M) are left out, saying why."""
    recipe = load_recipe("tiny", ["model.preset=llama3.1-8b", "data.seq_len=1048576",
                                "data.batch_size=1", "attention.impl=splash"])
    result = planner.plan(recipe, V5P, CONTEXT4)
    assert [p.name for p in result.plans] == ["ring"]
    assert "262144 queries x 1048576 keys" in result.skipped["all_gather"]
    assert {"ulysses", "usp"} <= set(result.skipped)


def test_recommendation_prefers_what_fits():
    recipe = tiny()
    small_chip = planner.plan(recipe, V5P, CONTEXT4)
    assert small_chip.choice.fits
    # A chip too small for anything: the least memory wins and the reason says so.
    import dataclasses
    tiny_chip = dataclasses.replace(V5P, hbm_bytes=1e3)
    result = planner.plan(recipe, tiny_chip, CONTEXT4)
    assert "none fits" in result.reason
    assert result.choice.hbm_bytes == min(p.hbm_bytes for p in result.plans)


def test_compiled_figures_decide_the_recommendation():
    """With --compile the compiler, not the estimate, says what fits: the estimated choice
    refused by the compiler (or over the host's memory) hands the recommendation on; a
    program it compiled fits even where memory_analysis()'s sum is above the HBM."""
    result = planner.plan(tiny(), V5P, CONTEXT4)
    estimated_choice = result.choice
    for strategy_plan in result.plans:
        strategy_plan.compiled = {"hbm_bytes": 2**30, "host_bytes": 0,
                                  "collective_bytes": {}}
    estimated_choice.compiled = {"hbm_bytes": None, "host_bytes": None,
                                 "collective_bytes": None, "error": "RESOURCE_EXHAUSTED"}
    choice, reason = planner.recommend(result.plans)
    assert choice is not estimated_choice and choice.deciding_fits
    assert f"{estimated_choice.name} would not fit" in reason
    assert f"{gigabytes(2**30)} of {gigabytes(V5P.hbm_bytes)}" in reason
    assert "compiled" in reason
    for strategy_plan in result.plans:
        strategy_plan.compiled["hbm_bytes"] = V5P.hbm_bytes + 1e9
    choice, reason = planner.recommend(result.plans)
    assert choice.deciding_fits and "103.80 GB of 102.80 GB" in reason
    assert "compiler checks the program's peak" in reason and "docs/memory.md" in reason
    for strategy_plan in result.plans:
        strategy_plan.compiled["host_bytes"] = V5P.host_bytes + 1
    choice, reason = planner.recommend(result.plans)
    assert "none fits" in reason and not any(p.deciding_fits for p in result.plans)


def test_auto_uses_the_planner():
    strategy, ulysses, reason = choose_strategy(tiny("parallel.strategy=auto"), CONTEXT4,
                                                95 * 2**30, platform="tpu")
    expected = planner.plan(tiny(), V5P, CONTEXT4, "tpu").choice
    assert (strategy, ulysses) == (expected.strategy, expected.ulysses)
    assert "of 102.01 GB per device" in reason  # 95 GiB, in the one unit shown


# ---------------------------------------------------------- remat options ----

def test_the_plan_offloads_one_layer_input_in_k_and_recomputes_the_rest():
    """llama3.1-8b at 128K on 4 v5p chips: groups of 2 halve the saved layer inputs, on the
    host when offloaded and on the device under full remat, hold the
    group's recomputed input in its backward (group_input_copies of one), and add one
    forward of half the layers."""
    sets = ["model.preset=llama3.1-8b", "model.dtype=bfloat16", "mesh.data=1",
            "mesh.context=4", "parallel.strategy=all_gather", "data.seq_len=131072",
            "data.batch_size=1"]

    def plans(remat):
        return (planner.estimate(
            load_recipe("tiny", [*sets, *remat, f"remat.layers_per_checkpoint={k}"]),
            CONTEXT4, V5P, "all_gather") for k in (1, 2))

    one_input = 131072 // 4 * 4096 * 2
    every_1, every_2 = plans(["remat.policy=custom",
                              "remat.tensors={decoder_layer_input: offload}"])
    assert every_1.host_bytes == 32 * one_input and every_2.host_bytes == 16 * one_input
    assert every_1.memory["group_inputs"] == 0
    assert every_2.memory["group_inputs"] == planner.CALIBRATION["group_input_copies"] * one_input
    assert every_2.memory["activations"] == every_1.memory["activations"] == 0
    full_1, full_2 = plans(["remat.policy=full"])
    assert full_2.memory["activations"] == full_1.memory["activations"] / 2 > 0
    assert every_2.compute_s > every_1.compute_s


def test_the_plan_says_it_leaves_out_the_compilers_own_remat():
    from lctrain.parallel.planner.accuracy import estimate_note
    without = estimate_note(load_recipe("tiny"), CONTEXT4) or ""  # other libtpus add a note
    note = estimate_note(load_recipe("tiny", ["remat.compiler_remat_percent=85"]), CONTEXT4)
    assert "remat.compiler_remat_percent" not in without
    assert "remat.compiler_remat_percent" in note and "--compile" in note


# ------------------------------------------------------------------ max seq ----

@pytest.mark.parametrize("limit", [1, 127, 128, 4096, 5000, 1_000_000])
def test_max_fitting_finds_the_last_length_that_fits(limit):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    found = planner.max_fitting(fits, 128)
    assert found == limit // 128 * 128
    assert found == 0 or fits(found)
    assert not fits(found + 128)
    assert all(n % 128 == 0 for n in calls)


def test_max_fitting_with_few_bisection_steps_stays_on_the_fitting_side():
    found = planner.max_fitting(lambda n: n <= 100_000, 128, bisect_steps=2)
    assert 65_536 <= found <= 100_000


def test_max_seq_len_fits_and_the_next_step_does_not():
    import dataclasses
    chip = dataclasses.replace(V5P, hbm_bytes=2 * 2**30)
    recipe = tiny()
    quantum = planner.sequence_quantum(recipe, CONTEXT4)
    for strategy in ("all_gather", "ring"):
        longest = planner.max_seq_len(recipe, CONTEXT4, chip, strategy)
        assert longest > 0 and longest % quantum == 0
        at = planner.estimate(planner.with_seq_len(recipe, longest), CONTEXT4, chip, strategy)
        beyond = planner.estimate(planner.with_seq_len(recipe, longest + quantum), CONTEXT4,
                                  chip, strategy)
        assert at.fits and not beyond.fits


def test_estimate_grows_with_the_sequence():
    for strategy in ("all_gather", "ulysses", "ring", "usp"):
        sizes = [planner.estimate(tiny(f"data.seq_len={s}"), CONTEXT4, V5P, strategy, 2).hbm_bytes
                 for s in (1024, 2048, 4096, 8192, 16384)]
        assert sizes == sorted(sizes)


# ---------------------------------------------------------- against XLA ----
#
# Accuracy grid on v5p:2x2x1 (mesh.context = 4, one sequence): the estimate against the
# compiled program's per-chip HBM (arguments + outputs + temporaries - aliased) and
# collective bytes (parallel/aot.py's counting). Each case is one compile (30 s to a few
# minutes on two cores), so the default grid is small; LCTRAIN_PLANNER_GRID=full runs the
# whole grid of the issue (2 models x 3 strategies x 2 remat policies x 2 lengths).

MODELS = {
    "tiny512": ("model.d_model=512", "model.n_heads=8", "model.n_kv_heads=2",
                "model.d_ff=1536", "model.layers=2"),
    "mid": ("model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=4",
            "model.d_ff=3584", "model.layers=4", "model.vocab=32768"),
}
FULL_GRID = [(model, seq, remat, strategy) for model in MODELS for seq in (8192, 32768)
             for remat in ("full", "minimal") for strategy in ("all_gather", "ulysses", "ring")]
# One compile by default: ring (its permutes among the collectives checked by kind) under
# minimal remat; all_gather and full remat are in the full grid.
SMALL_GRID = [("tiny512", 8192, "minimal", "ring")]
GRID = FULL_GRID if os.environ.get("LCTRAIN_PLANNER_GRID") == "full" else SMALL_GRID
# How close the full grid comes: parallel/planner/calibration.json ("small") and
# benchmarks/RESULTS.md, "Planner accuracy, round by round".
HBM_TOLERANCE = 0.15
COMM_TOLERANCE = 0.05


def grid_recipe(model, seq, remat, strategy):
    return load_recipe("tiny", ["model.dtype=bfloat16", "attention.impl=xla", *MODELS[model],
                              f"data.seq_len={seq}",
                              "data.batch_size=1", "mesh.data=1", "mesh.context=4",
                              f"parallel.strategy={strategy}", f"remat.policy={remat}"])


def grid_case(model, seq, remat, strategy):
    """A point the installed libtpu compiles outside the tolerance, as calibration.json
    records it (the plan names the release the calibration comes from), is expected to
    fail."""
    from lctrain.parallel.planner.accuracy import accuracy, installed_libtpu
    small = accuracy()["by_libtpu"].get(installed_libtpu(), {}).get("grids", {}).get("small", {})
    error = small.get("outside", {}).get(f"{model} v5p:2x2x1 {seq // 1024}K {remat} {strategy}")
    marks = ([pytest.mark.xfail(strict=True, reason=f"estimate {error:+.1%} off this libtpu's")]
             if error is not None else [])
    return pytest.param(model, seq, remat, strategy, marks=marks)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("model, seq, remat, strategy", [grid_case(*case) for case in GRID])
def test_estimate_matches_the_compiler(model, seq, remat, strategy):
    from lctrain.parallel import aot
    from lctrain.trainer.state.build import compile_train_step
    recipe = grid_recipe(model, seq, remat, strategy)
    compiled = planner.compile_figures(recipe, aot.topology_devices("v5p:2x2x1"),
                                       compile_train_step)
    estimate = planner.estimate(recipe, CONTEXT4, V5P, strategy)
    hbm_gap = planner.gap_percent(estimate.hbm_bytes, compiled["hbm_bytes"])
    comm_gap = planner.gap_percent(estimate.comm_bytes, sum(compiled["collective_bytes"].values()))
    print(f"\n{model} {seq} {remat} {strategy}: HBM {compiled['hbm_bytes']:,} "
          f"({hbm_gap:+.1f}%), collectives ({comm_gap:+.1f}%)")
    assert abs(hbm_gap) <= 100 * HBM_TOLERANCE
    assert abs(comm_gap) <= 100 * COMM_TOLERANCE
    for kind, nbytes in compiled["collective_bytes"].items():
        assert estimate.comm[kind] == pytest.approx(nbytes, rel=0.1, abs=0.02 * estimate.comm_bytes)


@pytest.mark.parametrize("start", [128, 1024, 65536, 2**20])
def test_max_fitting_from_any_start(start):
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 40_000

    assert planner.max_fitting(fits, 128, start=start) == 40_000 // 128 * 128
    # From a start near the answer the search takes few probes (compiles, with --compile).
    if start == 65536:
        assert len(calls) <= 12
