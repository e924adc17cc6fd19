"""Qwen3-Next: its full-attention layer (model.attention_output_gate,
model.partial_rotary_factor, q/k norms and norms centred on 0) against transformers'
Qwen3NextAttention with the same random weights, and a dense random Qwen3NextForCausalLM
(linear and full-attention layers) imported with model.init=hf:<dir>, its logits and loss
against transformers' (PyTorch, CPU, f32), and exported back; the one-line refusals."""

import json

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention,
                                                                Qwen3NextRotaryEmbedding)

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.model.rope import rotary_tables
from lctrain.trainer.model.transformer import Attention

from make_hf_model import make_qwen3_next_model
from reference import dense_attention
from test_hf import (BATCH, SEQ, assert_logits_close, hf_logits_and_loss, our_loss, recipe_for,
                     tokens)
from test_hf_gemma3 import exported_and_reloaded, our_logits

E, H, KV, D, TOKENS = 32, 4, 2, 16, 24
QWEN3_NEXT_ATTENTION = [f"model.d_model={E}", f"model.n_heads={H}", f"model.n_kv_heads={KV}",
                        f"model.head_dim={D}", "model.qk_norm=true", "model.norm_offset=1.0",
                        "model.norm_eps=1e-6", "model.rope_theta=10000.0",
                        "model.attention_output_gate=true"]


def torch_attention(rotary_factor):
    config = Qwen3NextConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=KV,
                             head_dim=D, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["full_attention"],
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": rotary_factor})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen3NextAttention(config, layer_idx=0).float()
    with torch.no_grad():
        for p in layer.parameters():   # norms included: centred on 0, so any value shows
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5))
    return layer, Qwen3NextRotaryEmbedding(config)


def copy_weights(ours, theirs):
    """q_proj holds each head's query then its gate; the rest is Llama's layout."""
    t = {name: p.detach().numpy() for name, p in theirs.named_parameters()}
    query_and_gate = t["q_proj.weight"].reshape(H, 2, D, E)
    values = dict(wq=query_and_gate[:, 0].transpose(2, 0, 1),
                  wg=query_and_gate[:, 1].transpose(2, 0, 1),
                  wk=t["k_proj.weight"].reshape(KV, D, E).transpose(2, 0, 1),
                  wv=t["v_proj.weight"].reshape(KV, D, E).transpose(2, 0, 1),
                  wo=t["o_proj.weight"].T.reshape(H, D, E))
    for name, value in values.items():
        getattr(ours, name)[...] = jax.numpy.asarray(value)
    ours.q_norm.scale[...] = jax.numpy.asarray(t["q_norm.weight"])
    ours.k_norm.scale[...] = jax.numpy.asarray(t["k_norm.weight"])


def causal_attend(q, k, v, positions, segment_ids):
    return dense_attention(q, k, v, positions, positions, segment_ids, segment_ids)[0]


@pytest.mark.parametrize("rotary_factor", [0.25, 1.0])
def test_attention_matches_transformers(rotary_factor):
    recipe = load_recipe("tiny", [*QWEN3_NEXT_ATTENTION,
                                  f"model.partial_rotary_factor={rotary_factor}"])
    theirs, rotary_embedding = torch_attention(rotary_factor)
    ours = Attention(recipe.model, nnx.Rngs(0))
    copy_weights(ours, theirs)
    x = np.random.default_rng(1).standard_normal((2, TOKENS, E)).astype(np.float32)
    positions = np.broadcast_to(np.arange(TOKENS, dtype=np.int32), (2, TOKENS))
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x), rotary_embedding(
            torch.from_numpy(x), torch.from_numpy(positions.astype(np.int64))), None)[0].numpy()
    rotary = rotary_tables(positions, recipe.model)
    got = jax.jit(lambda x: ours(x, positions, np.ones_like(positions), rotary,
                                 causal_attend))(x)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("factor", [0.0, 1.5, 0.1875])  # 0.1875 x 16: 3 features
def test_a_rotated_share_rope_cannot_take_names_the_key(factor):
    with pytest.raises(RecipeError, match=f"recipe key 'model.partial_rotary_factor' = {factor}"):
        load_recipe("tiny", [*QWEN3_NEXT_ATTENTION, f"model.partial_rotary_factor={factor}"])


@pytest.mark.parametrize("key, value", [("attention_output_gate", "true"),
                                        ("partial_rotary_factor", "0.25")])
def test_export_refuses_what_a_llama_config_cannot_say(key, value):
    from lctrain.recipes.hf_config import check_exportable

    recipe = load_recipe("tiny", [f"model.{key}={value}"])
    with pytest.raises(RecipeError, match=f"recipe key 'model.{key}' = ") as err:
        check_exportable(recipe.model)
    assert "\n" not in str(err.value)


LINEAR, FULL = "linear_attention", "full_attention"
LAYER_TYPES = [LINEAR, LINEAR, FULL, LINEAR]  # one repeat of 3, and a linear layer after


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_next")
    # Not transformers' default share of RoPE (0.25), so a key left unread would show.
    return folder, make_qwen3_next_model(folder, layer_types=LAYER_TYPES, rotary_factor=0.5)


def test_config_maps_to_the_model_keys(qwen3_next):
    folder, _ = qwen3_next
    model = recipe_for(folder).model
    assert model.family == "qwen3_next"
    assert model.layer_kinds() == ["linear", "linear", "global", "linear"]
    assert (model.partial_rotary_factor, model.attention_output_gate, model.qk_norm,
            model.norm_offset) == (0.5, True, True, 1.0)
    assert (model.linear_key_heads, model.linear_value_heads, model.linear_key_head_dim,
            model.linear_value_head_dim, model.linear_conv_kernel) == (2, 4, 8, 8, 4)


def test_logits_and_loss_match_transformers(qwen3_next):
    folder, model = qwen3_next
    ids = tokens()
    reference_logits, reference_loss = hf_logits_and_loss(model, ids)
    recipe = recipe_for(folder, "model.linear_chunk=8")
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ))
    ours = our_logits(recipe, ids[:, :SEQ], positions, np.ones((BATCH, SEQ), np.int32))
    assert_logits_close(ours, reference_logits)
    assert our_loss(recipe, ids, jax.devices()[:1]) == pytest.approx(reference_loss, rel=1e-4)


def test_experts_are_refused_in_one_line(qwen3_next, tmp_path):
    folder, _ = qwen3_next
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts": 8}))
    with pytest.raises(RecipeError, match="num_experts 8 puts experts in layer 0 .*dense") as err:
        recipe_for(tmp_path)
    assert "\n" not in str(err.value)


def test_export_reloads_in_transformers_with_the_same_logits(qwen3_next, tmp_path):
    """The fused tensors put back together: the reloaded model's logits are the original's,
    and the rotated share of each head is still 0.5."""
    folder, model = qwen3_next
    config, reloaded = exported_and_reloaded(folder, tmp_path)
    assert config["model_type"] == "qwen3_next" and config["layer_types"] == LAYER_TYPES
    assert reloaded.config.rope_parameters["partial_rotary_factor"] == 0.5
    ids = tokens(4)
    assert_logits_close(hf_logits_and_loss(reloaded, ids)[0], hf_logits_and_loss(model, ids)[0])
