"""model.layer_pattern: global and sliding-window layers mixed (one scan step per layer,
its kind picked by a switch), each kind with its own context-parallel strategy
(parallel.strategy: {global: ring, sliding: halo}), against per-layer references and the
single device."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.parallel import make_strategy
from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.model.rope import rotary_tables
from lctrain.trainer.model.transformer import Transformer
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import make_forward

from helpers import fast_jit, one_worker
from reference import dense_attention
from test_strategies import (SEQ, assert_matches, loss_and_grads, mixed_batch,
                             recipe_for)

# halo on mesh.context 4, load-balanced: window - 1 must fit in a stored chunk (64 / 8).
WINDOW = 8
SLIDING_THETA = 1000.0


def pattern(window=WINDOW, theta=SLIDING_THETA, sliding=2):
    """`sliding` sliding layers then a global one."""
    rope = f", rope_theta: {theta}" if theta else ""
    return f"[{{kind: sliding, count: {sliding}, window: {window}{rope}}}, {{kind: global}}]"


# Over 7 layers the pattern repeats twice, and its first layer ends the model.
MODEL = ["model.layers=7", f"model.layer_pattern={pattern()}"]
KINDS = ["sliding", "sliding", "global", "sliding", "sliding", "global", "sliding"]
# Under the strategies (a compile each) a shorter one: sliding, global, sliding.
SHORT_MODEL = ["model.layers=3", f"model.layer_pattern={pattern(sliding=1)}"]


def single_device_logits(recipe):
    """Logits of the mixed batch as the train step's forward computes them on one device
    (strategy none: the kernels' own window mask), and the model."""
    strategies = make_strategy(recipe, mesh_for(recipe, jax.devices()[:1]))
    model = Transformer(recipe.model, nnx.Rngs(3))
    graphdef, params = nnx.split(model)
    forward = make_forward(recipe, graphdef, strategies)
    batch = mixed_batch(recipe.model.vocab, SEQ)

    def logits(params, batch):
        model, hidden = forward(params, batch)
        return hidden @ model.output_weights()

    fields = {name: getattr(batch, name) for name in ("inputs", "positions", "segment_ids")}
    return np.asarray(fast_jit(logits, params, fields)(params, fields)), model


def dense_attend(window):
    def attend(q, k, v, positions, segment_ids):
        out, _ = dense_attention(q, k, v, positions, positions, segment_ids, segment_ids,
                                 window=window)
        return out.astype(q.dtype)
    return attend


def per_layer_logits(model, cfg, batch):
    """The layers one at a time in a Python loop (no scan), each with its kind's dense
    mask and rotary tables, written out from KINDS rather than read from the pattern."""
    graphdef, stacked = nnx.split(model.layers)
    global_cfg = dataclasses.replace(cfg, layer_pattern=None)
    x = model.embedding[...][batch.inputs]
    for i, kind in enumerate(KINDS):
        sliding = kind == "sliding"
        theta = SLIDING_THETA if sliding else cfg.rope_theta
        rotary = rotary_tables(batch.positions, dataclasses.replace(global_cfg, rope_theta=theta))
        layer = nnx.merge(graphdef, jax.tree.map(lambda p: p[i], stacked))
        x = layer(x, batch.positions, batch.segment_ids, rotary,
                  dense_attend(WINDOW if sliding else None))
    return np.asarray(model.final_norm(x) @ model.output_weights())


def test_mixed_layers_match_a_per_layer_reference():
    recipe = recipe_for("none", {"data": 1}, 2, extra=MODEL)
    assert recipe.model.layer_kinds() == KINDS
    logits, model = single_device_logits(recipe)
    expected = per_layer_logits(model, recipe.model, mixed_batch(recipe.model.vocab, SEQ))
    np.testing.assert_allclose(logits, expected, rtol=2e-5, atol=2e-5)


def test_windows_as_long_as_the_sequence_are_global_attention():
    """Same weights: sliding layers whose window covers the sequence give the global-only
    model's logits; a short window does not (so the comparison can fail)."""
    global_only, _ = single_device_logits(recipe_for("none", {"data": 1}, 2, extra=MODEL[:1]))
    for window, equal in [(SEQ, True), (WINDOW, False)]:
        recipe = recipe_for("none", {"data": 1}, 2,
                            extra=[MODEL[0], f"model.layer_pattern={pattern(window, theta=None)}"])
        logits, _ = single_device_logits(recipe)
        assert np.allclose(logits, global_only, rtol=1e-5, atol=1e-5) == equal, window


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads(recipe_for("none", {"data": 1}, 2, extra=SHORT_MODEL),
                          jax.devices()[:1])


PER_KIND = "{global: ring, sliding: halo}"


@one_worker("test_layer_pattern_reference")  # the reference computed once, not per worker
@pytest.mark.parametrize("strategy, load_balance, extra", [
    (PER_KIND, True, []), ("all_gather", True, []), ("ulysses", True, []), ("ring", True, []),
    # halo exchanges over usp's ring x all-to-all split of the sequence too, here in the
    # natural order (each halo case a compile: one balanced, one not)
    ("{global: usp, sliding: halo}", False, ["parallel.ulysses=2"])],
    ids=["ring+halo", "all_gather", "ulysses", "ring", "usp+halo-unbalanced"])
def test_train_step_matches_single_device(reference, strategy, load_balance, extra):
    """Loss and gradients under context parallelism 4 (data 2), a strategy per kind or one
    for all, equal the single device's."""
    recipe = recipe_for(strategy, {"data": 2, "context": 4}, 2, load_balance,
                        extra=[*SHORT_MODEL, *extra])
    assert_matches(reference, *loss_and_grads(recipe, jax.devices()))


def test_every_kind_stores_the_sequence_alike():
    recipe = recipe_for(PER_KIND, {"data": 2, "context": 4}, 2, extra=SHORT_MODEL)
    strategies = make_strategy(recipe, mesh_for(recipe))
    ring, halo = strategies.by_kind["global"], strategies.by_kind["sliding"]
    assert (ring.name, halo.name) == ("ring", "halo")
    assert strategies.name == "global: ring, sliding: halo"
    assert ring.load_balance and halo.load_balance
    np.testing.assert_array_equal(ring.sequence_order(SEQ), halo.sequence_order(SEQ))


CONTEXT = ["mesh.context=4", "mesh.data=2"]


@pytest.mark.parametrize("overrides, key, words", [
    (["model.layer_pattern=[{kind: local, count: 2}]"], "model.layer_pattern[0].kind",
     "allowed: global, sliding"),
    (["model.layer_pattern=[{kind: sliding, count: 2}]"], "model.layer_pattern[0].window",
     "needs a window >= 1"),
    (["model.layer_pattern=[{kind: sliding, count: 2, window: 0}]"],
     "model.layer_pattern[0].window", "needs a window >= 1"),
    (["model.layer_pattern=[{kind: sliding, count: 0, window: 4}]"],
     "model.layer_pattern[0].count", "must be >= 1"),
    (["model.layer_pattern=[{kind: global, window: 4}]"], "model.layer_pattern[0].window",
     "only sliding groups take a window"),
    ([*SHORT_MODEL, *CONTEXT, "parallel.strategy={global: ring, local: halo}"],
     "parallel.strategy.local", "unknown layer kind"),
    ([*CONTEXT, "parallel.strategy={global: ring, sliding: halo}"],
     "parallel.strategy.sliding", "the model has no sliding layers"),
    ([*SHORT_MODEL, *CONTEXT, "parallel.strategy={global: ring}"], "parallel.strategy",
     "names no strategy for the sliding layers"),
    ([*SHORT_MODEL, *CONTEXT, "parallel.strategy={global: halo, sliding: halo}"],
     "parallel.strategy.global", "halo runs sliding layers only"),
    ([*CONTEXT, "parallel.strategy=halo"], "parallel.strategy",
     "halo runs sliding layers only"),
    ([*SHORT_MODEL, *CONTEXT, "parallel.strategy={global: ring, sliding: usp}",
      "parallel.ulysses=2"], "parallel.strategy.global", "which ring does not run on"),
])
def test_bad_patterns_and_strategy_maps_stop_at_load(overrides, key, words):
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny", overrides)
    assert f"'{key}'" in str(err.value) and words in str(err.value)


def test_cli_reports_a_bad_strategy_map_in_one_line_and_exits_2(tmp_path):
    result = CliRunner().invoke(app, ["run", "--run-dir", str(tmp_path),
                                      *[a for s in [*SHORT_MODEL, *CONTEXT] for a in ("--set", s)],
                                      "--set",
                                      "parallel.strategy={global: halo, sliding: halo}"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "'parallel.strategy.global' = 'halo'" in lines[0]


def test_the_run_names_a_strategy_per_kind():
    from lctrain.parallel.auto import strategy_name

    assert strategy_name({"global": "usp", "sliding": "halo"}, 2) == \
        "global: usp (ulysses 2), sliding: halo"
    assert strategy_name("ring", 1) == "ring"


def test_export_refuses_sliding_layers_before_reading_weights():
    """A Llama config.json has no sliding layers: exported, the model would be served with
    every layer global. check_exportable runs first in export_run."""
    from lctrain.recipes import RecipeError, load_recipe
    from lctrain.recipes.hf_config import check_exportable

    check_exportable(load_recipe("tiny").model)
    sliding = load_recipe("tiny", ["model.layer_pattern=[{kind: sliding, count: 1, window: 8}, "
                                 "{kind: global, count: 1}]"])
    with pytest.raises(RecipeError, match="model.layer_pattern.*sliding-window layers"):
        check_exportable(sliding.model)
