"""The model's arithmetic (parallel/model_arithmetic.py), counted by hand, and read by both
the run's MFU and the planner's step time."""

import math
from pathlib import Path

import jax
import pytest
import yaml

from helpers import TINY_MODEL, tiny_recipe
from lctrain.parallel import planner
from lctrain.parallel.chips import CHIPS
from lctrain.parallel.model_arithmetic import count_parameters, training_flops_per_token
from lctrain.recipes import MODEL_PRESETS, load_recipe
from lctrain.trainer.train import loop

# helpers.TINY_MODEL by hand: 2 layers of width 128, 8 query and 2 KV heads of 16, d_ff
# 384, vocab 128, embedding and unembedding untied.
LAYER = (128 * 8 * 16 * 2        # wq, wo
         + 128 * 2 * 16 * 2      # wk, wv
         + 3 * 128 * 384         # gate, up, down
         + 2 * 128)              # the two norms
PARAMETERS = 2 * 128 * 128 + 2 * LAYER + 128   # embeddings, layers, final norm


def test_training_flops_per_token_by_hand():
    """6 per parameter (a multiply-add forward, two backward), and attention: per layer a
    causal query meets s/2 keys on average, twice (q.k and p.v) at 2 flops per
    multiply-add over 8 heads of 16, times three for forward and backward."""
    model = tiny_recipe(TINY_MODEL).model
    assert count_parameters(model) == PARAMETERS == 410_240
    per_layer_forward = 2 * 2 * (4096 / 2) * 8 * 16     # (q.k, p.v) x 2 x keys x heads x d
    attention = 3 * 2 * per_layer_forward
    assert training_flops_per_token(model, 4096) == 6 * PARAMETERS + attention == 8_752_896


def test_the_planner_and_the_run_count_the_same_model_flops():
    recipe = tiny_recipe(TINY_MODEL, "data.batch_size=2", "mesh.data=1", "mesh.context=4",
                         "parallel.strategy=ring")
    plan = planner.estimate(recipe, {"data": 1, "fsdp": 1, "context": 4, "tensor": 1},
                            CHIPS["v5p"], "ring")
    per_device = 2 * 4096 * loop.training_flops_per_token(recipe.model, 4096) / 4
    assert plan.model_flops == pytest.approx(per_device, rel=1e-12)


RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# What the parameter inventory must count: every preset, every shipped recipe whose shape
# is its own (not a Hugging Face folder's: their layer patterns, sliding, global, linear),
# and the options that add parameters (Qwen2's biases were once left out).
SHAPES = {
    **{preset: ("tiny", [f"model.preset={preset}"]) for preset in MODEL_PRESETS},
    **{path.name: (str(path), []) for path in sorted(RECIPES.glob("*.yaml"))
       if "init" not in (yaml.safe_load(path.read_text()).get("model") or {})},
    "qwen2_qkv_bias": ("tiny", ["model.qkv_bias=true"]),
    "qk_norm": ("tiny", ["model.qk_norm=true"]),
    "gemma_norms_tied": ("tiny", ["model.post_norms=true", "model.tie_embeddings=true"]),
    "qwen3_next_gate": ("tiny", ["model.attention_output_gate=true",
                                 "model.partial_rotary_factor=0.25"]),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_is_what_the_model_creates(shape):
    """The one parameter inventory (parallel/model_arithmetic.py, which the planner and the
    run's MFU read) against the parameters the model itself creates, abstractly."""
    from flax import nnx

    from lctrain.trainer.model.transformer import Transformer
    recipe = load_recipe(*SHAPES[shape])
    model = nnx.eval_shape(lambda: Transformer(recipe.model, nnx.Rngs(0)))
    created = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count_parameters(recipe.model) == created
