"""Gemma 3 text import (and export) against transformers' Gemma3ForCausalLM: the same random
checkpoint gives the same logits and loss (PyTorch, float32, CPU). Its sliding window is
shorter than the sequence, its layer pattern repeats over the layers, its attention scale
is not 1/sqrt(head_dim) and its linear RoPE scaling stretches the global layers only, so
each of those would show if it were wrong."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from lctrain.parallel import make_strategy, planner
from lctrain.recipes import RecipeError, load_recipe
from lctrain.recipes.hf_config import check_exportable
from lctrain.trainer.hf.export import export_hf
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.step import make_forward
from lctrain.trainer.train.resume import check_rerun

from make_hf_model import make_gemma3_model
from test_hf import (BATCH, SEQ, assert_logits_close, hf_logits_and_loss, loaded, our_loss,
                     recipe_for, tokens)
from test_hf_errors import run_fails

WINDOW = 8  # of SEQ = 64 tokens: the sliding layers see far less than the global ones
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = [SLIDING, SLIDING, FULL] * 2 + [SLIDING]  # two repeats, then a partial one
LINEAR = dict(rope_type="linear", factor=2.0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    model = make_gemma3_model(folder, layer_types=LAYER_TYPES, sliding_window=WINDOW,
                              rope_scaling=LINEAR)
    return folder, model


def our_logits(recipe, inputs, positions, segment_ids):
    """Logits [b, s, vocab] as the train step's forward computes them on one device."""
    _, trainable, params = loaded(recipe, jax.devices()[:1])
    strategies = make_strategy(recipe, mesh_for(recipe, jax.devices()[:1]))
    forward = make_forward(recipe, trainable.graphdef, strategies)
    batch = {"inputs": inputs, "positions": positions, "segment_ids": segment_ids}

    @jax.jit
    def logits(params, batch):
        model, hidden = forward(params, batch)
        return hidden @ model.output_weights()

    return np.asarray(logits(params, batch))


def test_config_maps_to_the_layer_pattern(gemma3):
    folder, _ = gemma3
    model = recipe_for(folder).model
    assert model.layer_kinds() == ["sliding", "sliding", "global"] * 2 + ["sliding"]
    sliding = model.layer_group("sliding")
    assert (sliding.window, sliding.rope_theta, sliding.scale_rope) == (WINDOW, 1e4, False)
    assert (model.rope_theta, model.rope_scaling.type, model.rope_scaling.factor) == (
        1e6, "linear", 2.0)
    assert (model.query_pre_attn_scalar, model.embedding_scale, model.tie_embeddings) == (
        24, 8.0, True)


def test_logits_and_loss_match_transformers(gemma3):
    folder, model = gemma3
    ids = tokens()
    reference_logits, reference_loss = hf_logits_and_loss(model, ids)
    recipe = recipe_for(folder)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))
    ours = our_logits(recipe, ids[:, :SEQ], positions, np.ones((BATCH, SEQ), np.int32))
    assert_logits_close(ours, reference_logits)
    assert our_loss(recipe, ids, jax.devices()[:1]) == pytest.approx(reference_loss, rel=1e-4)


def test_context_parallel_loss_matches_transformers(gemma3):
    """Ring on the global layers, halo on the sliding ones (data 2 x context 4, load
    balanced): the loss transformers gives on one device."""
    folder, model = gemma3
    ids = tokens(5)
    recipe = recipe_for(folder, "parallel.strategy={global: ring, sliding: halo}",
                        "mesh.data=2", "mesh.context=4")
    assert our_loss(recipe, ids, jax.devices()) == pytest.approx(
        hf_logits_and_loss(model, ids)[1], rel=1e-4)


def test_packed_documents_match_each_document_alone(gemma3):
    """Two documents packed in one row (positions restart, segment ids differ) give the
    logits transformers gives each document on its own."""
    folder, model = gemma3
    first, second = 40, SEQ - 40
    ids = tokens(3)[:1, :SEQ]
    positions = np.concatenate([np.arange(first), np.arange(second)]).astype(np.int32)[None]
    segments = np.repeat([1, 2], [first, second]).astype(np.int32)[None]
    ours = our_logits(recipe_for(folder), ids, positions, segments)
    for start, stop in [(0, first), (first, SEQ)]:
        with torch.no_grad():
            alone = model(input_ids=torch.tensor(ids[:, start:stop], dtype=torch.long)).logits
        assert_logits_close(ours[:, start:stop], alone.numpy())


def exported_and_reloaded(folder, out):
    """The model imported from `folder`, exported in f32 to `out`: (its config.json, the
    export as transformers loads it)."""
    recipe = recipe_for(folder)
    _, _, params = loaded(recipe, jax.devices()[:1])
    export_hf(recipe, params, out, "float32")
    return (json.loads((out / "config.json").read_text()),
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval())


def test_export_reloads_in_transformers_with_the_same_logits(gemma3, tmp_path):
    folder, model = gemma3
    config, reloaded = exported_and_reloaded(folder, tmp_path)
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == LAYER_TYPES
    assert reloaded.config.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert reloaded.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    ids = tokens(4)
    assert_logits_close(hf_logits_and_loss(reloaded, ids)[0], hf_logits_and_loss(model, ids)[0])


def test_export_refuses_rope_scaling_on_sliding_layers(gemma3):
    folder, _ = gemma3
    model = recipe_for(folder).model
    first, *rest = model.layer_pattern
    model = dataclasses.replace(
        model, layer_pattern=[dataclasses.replace(first, scale_rope=True), *rest])
    with pytest.raises(RecipeError, match=r"model.layer_pattern\[0\].scale_rope"):
        check_exportable(model)


def test_unsupported_config_key_is_refused(gemma3, tmp_path):
    folder, _ = gemma3
    target = tmp_path / "softcapped"
    target.mkdir()
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    line = run_fails(target, tmp_path)
    assert "final_logit_softcapping 30.0 is not supported" in line


def test_a_run_dir_from_before_these_keys_resumes(tmp_path):
    """A recipe.yaml written before the Gemma keys (model.qk_norm, ..., a group's
    scale_rope) existed reads as their defaults, so its run resumes."""
    model = ["model.layers=3", "model.layer_pattern=[{kind: sliding, count: 2, window: 8}, "
                               "{kind: global}]"]
    recipe = load_recipe("tiny", model)
    written = recipe.to_dict()
    for key in ("norm_offset", "qk_norm", "post_norms", "mlp_activation", "embedding_scale",
                "query_pre_attn_scalar"):
        del written["model"][key]
    for group in written["model"]["layer_pattern"]:
        del group["scale_rope"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(written))
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # trained: a step was saved
    assert check_rerun(recipe, tmp_path) is None
    changed = load_recipe("tiny", [*model, "model.qk_norm=true"])
    with pytest.raises(RecipeError, match="model.qk_norm False -> True"):
        check_rerun(changed, tmp_path)


def test_parameter_counts_include_the_new_norms(gemma3):
    """The parameter count equals the parameters the import fills: four
    d_model norms and two head_dim q/k norms per layer, the embedding tied."""
    folder, model = gemma3
    recipe = recipe_for(folder)
    _, _, params = loaded(recipe, jax.devices()[:1])
    loaded_count = sum(leaf.size for leaf in jax.tree.leaves(params))
    assert loaded_count == sum(p.numel() for p in model.parameters())
    assert planner.count_parameters(recipe.model) == loaded_count
