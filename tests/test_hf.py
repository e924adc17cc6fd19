"""Hugging Face import against transformers itself: the same checkpoint gives the same
logits and next-token loss (PyTorch, float32, CPU), for every family, RoPE type and
context-parallel strategy. Checkpoints are made here with transformers' random init."""

import json
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from lctrain.kernels import attention
from lctrain.parallel import make_strategy
from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data.batches import Batch
from lctrain.trainer.hf.weights import initial_state
from lctrain.trainer.state.build import device_batch, mesh_for
from lctrain.trainer.state.step import BATCH_FIELDS, build_trainable, make_loss_sums

from helpers import assert_close
from make_hf_model import make_hf_model

SEQ, BATCH, VOCAB = 64, 2, 256
RELATIVE = 1e-4


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)


def hf_logits_and_loss(model, ids):
    """ids [batch, seq + 1]: the model reads the first seq tokens."""
    inputs = torch.tensor(ids[:, :-1], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=inputs, labels=inputs)
    return out.logits.numpy(), float(out.loss)


def recipe_for(folder, *extra):
    return load_recipe("tiny", [f"model.init=hf:{folder}", "model.dtype=float32",
                              f"data.seq_len={SEQ}", f"data.batch_size={BATCH}",
                              "attention.block_kv=16", *extra])


def loaded(recipe, devices):
    mesh = mesh_for(recipe, devices)
    trainable = build_trainable(recipe, mesh)
    return mesh, trainable, initial_state(recipe, trainable).params


def our_logits(recipe, ids):
    _, trainable, params = loaded(recipe, jax.devices()[:1])
    model = nnx.merge(trainable.graphdef, params)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))
    segments = np.ones((BATCH, SEQ), np.int32)

    def attend(q, k, v, pos, seg):
        return attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                         kv_segment_ids=seg, block_kv=16)

    hidden = jax.jit(lambda: model(ids[:, :SEQ], positions, segments, attend=attend))()
    return np.asarray(hidden @ model.output_weights())


def our_loss(recipe, ids, devices, params=None):
    """Mean next-token loss of ids [batch, seq + 1] as transformers counts it, under the
    recipe's strategy; the weights are model.init's unless `params` are given."""
    mesh = mesh_for(recipe, devices)
    trainable = build_trainable(recipe, mesh)
    if params is None:
        params = initial_state(recipe, trainable).params
    strategy = make_strategy(recipe, mesh)
    shape = (ids.shape[0], ids.shape[1] - 1)
    mask = np.ones(shape, np.float32)
    mask[:, -1] = 0  # transformers' shifted labels predict seq - 1 tokens per row
    fixed = Batch(ids[:, :-1], ids[:, 1:], np.broadcast_to(np.arange(shape[1], dtype=np.int32),
                                                           shape),
                  np.ones(shape, np.int32), mask)
    source = SimpleNamespace(cfg=recipe.data, batch=lambda index, rows: Batch(
        *(getattr(fixed, name)[rows] for name in BATCH_FIELDS)))
    batch = device_batch(source, 0, strategy.sequence_order(shape[1]), mesh)
    total, aux = jax.jit(make_loss_sums(recipe, trainable.graphdef, strategy))(params, batch)
    return float(total / aux.tokens)


def assert_logits_close(ours, reference):
    """Within RELATIVE of the reference's largest logit."""
    bound = RELATIVE * float(np.max(np.abs(reference)))
    assert_close({"logits": ours}, {"logits": reference}, bound)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
CASES = {
    "llama_gqa": dict(),
    "llama_mha_tied": dict(kv_heads=4, tie=True),
    "llama_llama3_rope": dict(rope_scaling=LLAMA3, rope_theta=500_000.0),
    "llama_yarn_rope": dict(rope_scaling=YARN),
    "llama_linear_rope": dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama_head_dim_32": dict(head_dim=32),
    "mistral": dict(family="mistral"),
    "qwen2_biases_tied": dict(family="qwen2", tie=True),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_loss_match_transformers(tmp_path, case):
    model = make_hf_model(tmp_path, **CASES[case])
    ids = tokens()
    reference_logits, reference_loss = hf_logits_and_loss(model, ids)
    recipe = recipe_for(tmp_path)
    assert_logits_close(our_logits(recipe, ids), reference_logits)
    assert our_loss(recipe, ids, jax.devices()[:1]) == pytest.approx(reference_loss,
                                                                     rel=RELATIVE)


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    model = make_hf_model(folder, rope_scaling=LLAMA3, rope_theta=500_000.0)
    ids = tokens(1)
    return folder, ids, hf_logits_and_loss(model, ids)[1]


# On 8 devices; ulysses splits the 4 query heads 4 ways, so its mesh is data 2 x context 4.
@pytest.mark.parametrize("strategy, extra", [
    ("all_gather", ["mesh.context=8"]), ("ulysses", ["mesh.data=2", "mesh.context=4"]),
    ("ring", ["mesh.context=8"]), ("usp", ["mesh.context=8", "parallel.ulysses=2"])])
def test_every_strategy_matches_transformers(llama3_checkpoint, strategy, extra):
    folder, ids, reference_loss = llama3_checkpoint
    recipe = recipe_for(folder, f"parallel.strategy={strategy}", *extra)
    assert our_loss(recipe, ids, jax.devices()) == pytest.approx(reference_loss, rel=RELATIVE)


def test_hub_and_transformers5_configs_read_alike(tmp_path, llama3_checkpoint):
    """Llama 3.1 on the hub writes rope_theta + rope_scaling; transformers 5 writes
    rope_parameters. Both must give the same recipe."""
    folder, _, _ = llama3_checkpoint
    config = json.loads((folder / "config.json").read_text())
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    config["rope_scaling"] = parameters
    (tmp_path / "config.json").write_text(json.dumps(config))
    hub, new = load_recipe("tiny", [f"model.init=hf:{tmp_path}"]).model, recipe_for(folder).model
    assert hub.rope_scaling == new.rope_scaling and hub.rope_theta == new.rope_theta == 5e5
    assert (hub.rope_scaling.type, hub.rope_scaling.factor) == ("llama3", 8.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sources_load_exactly(tmp_path, dtype):
    model = make_hf_model(tmp_path, dtype=dtype)
    _, _, params = loaded(recipe_for(tmp_path), jax.devices()[:1])
    stored = getattr(torch, dtype)
    wq = model.model.layers[1].self_attn.q_proj.weight.detach().to(stored).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["layers"]["attention"]["wq"][1]),
                                  wq.T.reshape(64, 4, 16))
    embed = model.model.embed_tokens.weight.detach().to(stored).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["embedding"]), embed)


def test_sharded_load_equals_single_device(llama3_checkpoint):
    folder, _, _ = llama3_checkpoint
    recipe = recipe_for(folder, "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2",
                        "parallel.strategy=ring")
    _, _, sharded = loaded(recipe, jax.devices())
    _, _, single = loaded(recipe_for(folder), jax.devices()[:1])
    assert len(sharded["layers"]["attention"]["wq"].sharding.device_set) == 8
    for ours, reference in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))
