"""The planner per layer kind (parallel/planner/layer_kinds.py): a model of global and
sliding-window layers (model.layer_pattern) is planned with each kind's strategy over its
own layers and window, and auto chooses a strategy per kind."""

import dataclasses

import jax
import pytest

from lctrain.parallel import planner
from lctrain.parallel.auto import choose_strategy, ranked_strategies
from lctrain.parallel.chips import CHIPS
from lctrain.parallel.halo import Halo
from lctrain.parallel.hlo import collective_bytes
from lctrain.parallel.model_arithmetic import keys_per_query, training_flops_per_token
from lctrain.parallel.planner import layer_kinds
from lctrain.parallel.planner.estimate import recipe_for_plan
from lctrain.parallel.planner.shapes import dims
from lctrain.recipes.loader import load_recipe
from lctrain.recipes.schema import RecipeError

V5P = CHIPS["v5p"]
CONTEXT4 = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
WINDOW = 64
ALL_GLOBAL = ["model.layers=7", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
              "model.head_dim=16", "model.d_ff=128", "model.vocab=256", "attention.impl=xla",
              "data.seq_len=1024", "data.batch_size=1", "mesh.data=1", "mesh.context=4"]
# 7 layers: sliding, sliding, global, sliding, sliding, global, sliding.
MIXED = [*ALL_GLOBAL,
         f"model.layer_pattern=[{{kind: sliding, count: 2, window: {WINDOW}}}, {{kind: global}}]"]
SLIDING_LAYERS, GLOBAL_LAYERS = 5, 2


def mixed(*overrides):
    return load_recipe("tiny", [*MIXED, "parallel.strategy={global: ring, sliding: halo}",
                              *overrides])


def plan_of(recipe, strategy):
    return planner.estimate(recipe, CONTEXT4, V5P, strategy)


def halo_bytes(recipe, layers):
    sliding = dataclasses.replace(dims(recipe, CONTEXT4, "halo", 1), layers=layers,
                                  window=WINDOW)
    return Halo.traffic(sliding)["strategy_halo"][1]


def test_halo_traffic_is_its_cost_model_over_the_sliding_layers():
    """K/V per sliding layer; the ids (the same in every layer) once per step in a model
    of sliding layers alone, but per layer and forward pass (2 under remat) where a
    switch picks each layer's kind: XLA hoists nothing out of a switch."""
    recipe = mixed()
    per_layer = halo_bytes(recipe, 2) - halo_bytes(recipe, 1)
    ids = halo_bytes(recipe, 1) - per_layer
    assert ids == 2 * (WINDOW - 1) * 8 and per_layer > 0
    p = plan_of(recipe, "ring")
    assert p.comm_detail["strategy_halo"] == SLIDING_LAYERS * (per_layer + 2 * ids)
    assert p.kinds["sliding"].comm_bytes == p.comm_detail["strategy_halo"]
    # Halo's traffic depends on the window, not the sequence.
    longer = plan_of(mixed("data.seq_len=4096"), "ring")
    assert longer.comm_detail["strategy_halo"] == p.comm_detail["strategy_halo"]


def test_the_kinds_add_up_to_the_totals():
    p = plan_of(mixed(), "ring")
    assert {kind: part.layers for kind, part in p.kinds.items()} == {
        "global": GLOBAL_LAYERS, "sliding": SLIDING_LAYERS}
    own = sum(nbytes for source, nbytes in p.comm_detail.items() if source.startswith("strategy"))
    assert sum(part.comm_bytes for part in p.kinds.values()) == pytest.approx(own)
    # The global layers' ring over 2 layers is 2/7 of the ring over the whole model.
    all_ring = plan_of(load_recipe("tiny", [*ALL_GLOBAL, "parallel.strategy=ring"]), "ring")
    assert p.comm_detail["strategy_ring"] == pytest.approx(
        all_ring.comm_detail["strategy_ring"] * GLOBAL_LAYERS / 7)


def test_sliding_layers_cost_window_over_sequence_attention_flops():
    recipe = mixed("data.seq_len=8192")
    s = recipe.data.seq_len
    sliding_share = (WINDOW - WINDOW * (WINDOW - 1) / (2 * s)) / (s / 2)
    assert keys_per_query(recipe.model, s) == pytest.approx(
        (GLOBAL_LAYERS + SLIDING_LAYERS * sliding_share) / 7)
    # Fewer attention flops than the same layers all global.
    all_global = load_recipe("tiny", [*ALL_GLOBAL, "data.seq_len=8192", "parallel.strategy=ring"])
    assert plan_of(recipe, "ring").model_flops < plan_of(all_global, "ring").model_flops


def test_a_model_without_a_pattern_plans_as_before():
    recipe = load_recipe("tiny", [*ALL_GLOBAL, "parallel.strategy=ring"])
    p = plan_of(recipe, "ring")
    assert p.kinds is None and "strategy_halo" not in p.comm_detail


def test_planned_halo_traffic_matches_the_compiled_hlo():
    """CPU compile of the whole train step (all_gather on the global layers, so halo's
    sends are the step's only collective-permutes)."""
    from lctrain.trainer.state import build
    recipe = mixed("parallel.strategy={global: all_gather, sliding: halo}")
    compiled = build.compile_train_step(recipe, jax.devices()[:4])
    counted = collective_bytes(compiled.as_text()).bytes_by_kind["collective-permute"]
    assert counted == plan_of(recipe, "all_gather").comm_detail["strategy_halo"]


@pytest.mark.parametrize("strategy", ["auto", "{global: auto, sliding: auto}",
                                      "{global: auto, sliding: halo}"])
def test_auto_picks_halo_for_sliding_layers_and_a_global_strategy(strategy):
    recipe = load_recipe("tiny", [*MIXED, f"parallel.strategy={strategy}"])
    choice, _, reason = choose_strategy(recipe, CONTEXT4, 95 * 2**30)
    assert choice["sliding"] == "halo" and choice["global"] in ("all_gather", "ulysses", "ring")
    expected = planner.plan(recipe, V5P, CONTEXT4).choice
    assert choice["global"] == expected.kinds["global"].strategy and " GB per device" in reason


def test_auto_keeps_a_kind_the_map_names():
    recipe = load_recipe("tiny", [*MIXED, "parallel.strategy={global: ring, sliding: auto}"])
    order, _ = ranked_strategies(recipe, CONTEXT4, 95 * 2**30)
    assert order == [({"global": "ring", "sliding": "halo"}, 1)]


def test_auto_runs_sliding_layers_on_the_global_strategy_when_the_window_is_too_wide():
    # 1024 tokens over 4 chips, load-balanced: chunks of 128 tokens; window - 1 = 199.
    recipe = load_recipe("tiny", [*MIXED, "parallel.strategy=auto",
                                "model.layer_pattern=[{kind: sliding, count: 2, window: 200}, "
                                "{kind: global}]"])
    choice, _, _ = choose_strategy(recipe, CONTEXT4, 95 * 2**30)
    assert choice["sliding"] == choice["global"] != "halo"


def test_auto_refuses_when_the_named_global_strategy_cannot_run():
    # Ulysses splits the heads over mesh.context (4): 2 heads do not divide.
    recipe = load_recipe("tiny", [*MIXED, "model.n_heads=2", "model.n_kv_heads=1",
                                "parallel.strategy={global: ulysses, sliding: auto}"])
    with pytest.raises(RecipeError) as err:
        ranked_strategies(recipe, CONTEXT4, 95 * 2**30)
    message = str(err.value)
    assert "'parallel.strategy.global' = 'ulysses'" in message and "\n" not in message


def test_plan_shows_each_kinds_choice_and_compiles_the_map():
    from rich.console import Console

    from lctrain.cli.plan_render import render
    result = planner.plan(mixed(), V5P, CONTEXT4)
    console = Console(record=True, width=400)
    render(result, console)
    text = console.export_text()
    assert "global: ring, sliding: halo" in text
    assert "sliding (5 layers, window 64): halo" in text and "global (2 layers)" in text
    # plan --compile compiles each plan's map, not its global strategy everywhere
    ring = next(p for p in result.plans if p.strategy == "ring")
    assert recipe_for_plan(mixed(), ring).parallel.strategy == {"global": "ring",
                                                               "sliding": "halo"}


@pytest.mark.parametrize("pattern, keys", [
    ("[{kind: sliding, count: 1, window: 64}, {kind: global}]",
     (1 + (64 - 64 * 63 / 1024) / 256) / 2),
    ("[{kind: linear, count: 3}, {kind: global}]", 1 / 4)])
def test_mfu_counts_attention_per_layer_kind(pattern, keys):
    """The run's MFU and the planner (parallel/model_arithmetic) count a sliding layer's
    window and no attention in linear layers: by hand, at 512 tokens, a [sliding, global]
    model's query sees (1 + (w - w(w-1)/2s) / (s/2)) / 2 of an all-global model's keys on
    average over its layers; [linear x3, global] a quarter."""
    recipe = load_recipe("tiny", ["model.layers=4", "data.seq_len=512",
                                f"model.layer_pattern={pattern}"])
    m = recipe.model
    attention = 6 * m.layers * 512 * m.n_heads * m.head_dim
    assert keys_per_query(m, 512) == pytest.approx(keys)
    assert training_flops_per_token(m, 512) == pytest.approx(
        6 * planner.count_parameters(m) + attention * keys)


@pytest.mark.parametrize("overrides", [
    [], ["model.layer_pattern=[{kind: linear, count: 1}]",
         "parallel.strategy={linear: state_passing}"]], ids=["3_linear_1_global", "all_linear"])
def test_the_planner_counts_the_parameters_a_linear_pattern_model_holds(overrides):
    """Attention tensors in the attention layers only (none in a model of linear layers
    alone), Gated DeltaNet's in the linear ones: the planner's tensor list against the
    model's own (abstract) parameters."""
    import math

    from flax import nnx

    from lctrain.trainer.model.transformer import Transformer
    recipe = load_recipe("qwen3_next_like", overrides)
    model = nnx.eval_shape(lambda: Transformer(recipe.model, nnx.Rngs(0)))
    held = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert planner.count_parameters(recipe.model) == held


def test_the_plan_says_its_estimate_is_rough_for_switched_layer_kinds(monkeypatch):
    from lctrain.parallel.planner import accuracy
    from lctrain.parallel.planner.accuracy import estimate_note
    monkeypatch.setattr(accuracy, "installed_libtpu", lambda: accuracy.CALIBRATED_LIBTPU)
    short = ["data.seq_len=8192"]   # 2K tokens per chip: no other reason to warn
    all_global = load_recipe("tiny", [*ALL_GLOBAL, *short, "parallel.strategy=ring"])
    assert estimate_note(all_global, CONTEXT4) is None
    note = estimate_note(mixed(*short), CONTEXT4)
    assert accuracy.accuracy()["notes"]["switched_layer_kinds"] in note and "--compile" in note


@pytest.mark.parametrize("libtpu, recorded", [("0.0.50.1", True), ("9.9.9", False)])
def test_the_plan_names_the_toolchain_its_calibration_comes_from(monkeypatch, libtpu, recorded):
    """Another libtpu's note gives the small models' grid as calibration.json records it
    for that release, or says it was not measured."""
    from lctrain.parallel.planner import accuracy
    monkeypatch.setattr(accuracy, "installed_libtpu", lambda: libtpu)
    recipe = load_recipe("tiny", [*ALL_GLOBAL, "data.seq_len=8192", "parallel.strategy=ring"])
    note = accuracy.estimate_note(recipe, CONTEXT4)
    small = accuracy.accuracy()["by_libtpu"].get(libtpu, {}).get("grids", {}).get("small")
    words = (f"within {small['worst']:.1%} (rms {small['rms']:.1%}) of the small models' grid"
             if recorded else "not measured against the compiler")
    assert f"its calibration comes from libtpu {accuracy.CALIBRATED_LIBTPU}" in note
    assert f"with the installed {libtpu} it is" in note and words in note


def test_planned_conv_sends_match_the_compiled_hlo():
    """Linear layers alone on state_passing over 4 CPU devices: the causal conv's sends
    (kernel-1 tokens of q, k, v before each run, per layer and forward pass, their
    gradients back, the ids once) are the step's only collective-permutes (the state maps
    are all-gathers), and the plan counts them byte for byte."""
    from lctrain.trainer.state import build
    recipe = load_recipe("tiny", [
        "model.layers=3", "model.d_model=32", "model.linear_key_heads=2",
        "model.linear_value_heads=4", "model.linear_key_head_dim=8",
        "model.linear_value_head_dim=8", "model.linear_conv_kernel=4", "model.linear_chunk=4",
        "model.layer_pattern=[{kind: linear}]", "parallel.strategy={linear: state_passing}",
        "data.seq_len=64", "data.batch_size=1", "mesh.data=1", "mesh.context=4"])
    compiled = build.compile_train_step(recipe, jax.devices()[:4])
    counted = collective_bytes(compiled.as_text()).bytes_by_kind["collective-permute"]
    planned = planner.plan(recipe, V5P, CONTEXT4, "cpu").plans[0].comm_detail
    assert counted == planned["strategy_conv_halo"]


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_a_linear_hybrid_holds_its_linear_layers_working_set(strategy):
    """The layer phase holds one layer's backward at a time, the largest kind's: on the
    Qwen3-Next-like recipe the linear layer's (wider projections, a 256K sequence on 16
    chips), calibrated as state_passing's own, whichever strategy the global layers take.
    With ring on them it was once the ring's alone (5.8 GB against the linear layers'
    8.2)."""
    from lctrain.parallel.planner.memory import CALIBRATION
    from lctrain.parallel.state_passing import StatePassing

    recipe = load_recipe("recipes/qwen3_next_like.yaml")
    axis_sizes = {"data": 4, "fsdp": 1, "context": 4, "tensor": 1}
    linear = layer_kinds.linear_dims(recipe, dims(recipe, axis_sizes, "state_passing", 1))
    expected = CALIBRATION["attention_copies"] * StatePassing.attention_footprint(
        linear).working_set
    plan = planner.estimate(recipe, axis_sizes, V5P, strategy)
    assert plan.memory["attention"] == pytest.approx(expected)
    assert expected > 3 * StatePassing.kernel_residuals(linear)  # more than its inputs
