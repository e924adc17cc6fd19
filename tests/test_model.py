"""The NNX model against a hand-written, layer-by-layer reference on the same weights."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lctrain.kernels import attention
from lctrain.recipes import load_recipe
from lctrain.trainer.model.loss import next_token_loss
from lctrain.trainer.model.rope import rope_frequencies
from lctrain.trainer.model.transformer import Transformer


def config(**overrides):
    sets = [f"model.{k}={v}" for k, v in overrides.items()]
    return load_recipe("tiny", ["model.dtype=float32", *sets]).model


def reference_logits(params, cfg, tokens, positions, segments):
    """Llama written out plainly: dense masked softmax, a Python loop over layers."""
    def rms(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    def rope(x):
        inv_freq, _ = rope_frequencies(cfg)
        angle = positions[..., None, None] * inv_freq            # [b, s, 1, d/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                                x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)

    group = cfg.n_heads // cfg.n_kv_heads
    allowed = ((segments[:, :, None] == segments[:, None, :])
               & (positions[:, :, None] >= positions[:, None, :]))
    x = params["embedding"][tokens]
    for i in range(cfg.layers):
        layer = jax.tree.map(lambda p: p[i], params["layers"])
        att = layer["attention"]
        h = rms(x, layer["attention_norm"]["scale"])
        q = rope(jnp.einsum("bse,ehd->bshd", h, att["wq"]))
        k = jnp.repeat(rope(jnp.einsum("bse,ehd->bshd", h, att["wk"])), group, axis=2)
        v = jnp.repeat(jnp.einsum("bse,ehd->bshd", h, att["wv"]), group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
        scores = jnp.where(allowed[:, None], scores, -jnp.inf)
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        x = x + jnp.einsum("bshd,hde->bse", context, att["wo"])
        h = rms(x, layer["mlp_norm"]["scale"])
        mlp = layer["mlp"]
        x = x + (jax.nn.silu(h @ mlp["gate"]) * (h @ mlp["up"])) @ mlp["down"]
    x = rms(x, params["final_norm"]["scale"])
    return x @ params["unembedding"]


def packed_batch(batch=2, seq=24, vocab=128):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq), dtype=np.int32)
    segments = np.ones((batch, seq), np.int32)
    segments[0, 10:] = 2          # row 0 packs two documents
    positions = np.zeros_like(segments)
    for row in range(batch):
        starts = np.r_[0, np.flatnonzero(np.diff(segments[row])) + 1]
        for start, end in zip(starts, np.r_[starts[1:], seq]):
            positions[row, start:end] = np.arange(end - start)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def model_logits(params, graphdef, tokens, positions, segments, policy=None):
    model = nnx.merge(graphdef, params)

    def attend(q, k, v, pos, seg):
        return attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                         kv_segment_ids=seg, block_kv=8)

    hidden = model(tokens, positions, segments, attend=attend, remat_policy=policy)
    return hidden @ model.output_weights()


# GQA 2 (4 KV heads) and MQA (1 KV head) over 3 layers; the tiny preset's own GQA 4 is
# what test_documents_do_not_see_each_other runs.
@pytest.mark.parametrize("overrides", [{"n_kv_heads": 4}, {"n_kv_heads": 1, "layers": 3}])
def test_forward_and_backward_match_the_reference(overrides):
    from helpers import fast_jit

    cfg = config(**overrides)
    graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(1)))
    params = nnx.to_pure_dict(state)
    tokens, positions, segments = packed_batch()
    targets = jnp.roll(tokens, -1, axis=1)
    cotangent = jax.random.normal(jax.random.key(2), (2, 24, cfg.vocab))

    def logits_and_grads(logits_fn):
        """The logits and the gradient of sum(logits x cotangent), in one compile."""
        def both(p):
            logits, vjp = jax.vjp(logits_fn, p)
            return logits, vjp(cotangent)[0]
        return fast_jit(both, params)(params)

    ours = lambda p: model_logits(p, graphdef, tokens, positions, segments,
                                  jax.checkpoint_policies.nothing_saveable)
    reference = lambda p: reference_logits(p, cfg, tokens, positions, segments)
    # Jitted: op by op, each of the reference's small operations compiled on its own.
    ours_logits, ours_grads = logits_and_grads(ours)
    reference_logits_, reference_grads = logits_and_grads(reference)
    np.testing.assert_allclose(ours_logits, reference_logits_, atol=2e-5, rtol=2e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(ours_grads),
                            jax.tree.leaves(reference_grads)):
        scale = float(jnp.max(jnp.abs(r)))
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-4 * scale, jax.tree_util.keystr(path)
    # The loss helper: mean next-token cross-entropy over the unmasked tokens.
    mask = jnp.ones_like(tokens, jnp.float32).at[:, -1].set(0)
    total, (count, _) = next_token_loss(jnp.eye(cfg.d_model)[None, :1].repeat(24, 1).repeat(2, 0),
                                   jnp.zeros((cfg.d_model, cfg.vocab)), targets, mask)
    assert float(count) == 46 and float(total) == pytest.approx(46 * math.log(cfg.vocab), 1e-5)


def test_documents_do_not_see_each_other():
    cfg = config()
    graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(1)))
    params = nnx.to_pure_dict(state)
    tokens, positions, segments = packed_batch()
    changed = tokens.at[0, :10].set((tokens[0, :10] + 1) % cfg.vocab)  # edit document 1 only
    before = model_logits(params, graphdef, tokens, positions, segments)
    after = model_logits(params, graphdef, changed, positions, segments)
    np.testing.assert_array_equal(before[0, 10:], after[0, 10:])
    assert float(jnp.max(jnp.abs(before[0, :10] - after[0, :10]))) > 1e-3


def test_llama31_rope_scaling_matches_the_published_rule():
    cfg = config(preset="llama3.1-8b")
    ours, _ = rope_frequencies(cfg)
    base = 1.0 / (500_000.0 ** (np.arange(0, 128, 2) / 128))
    expected = []
    for freq in base:  # Meta's reference code for Llama 3.1, one frequency at a time
        wavelength = 2 * math.pi / freq
        if wavelength < 8192 / 4:
            expected.append(freq)
        elif wavelength > 8192 / 1:
            expected.append(freq / 8)
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            expected.append((1 - smooth) * freq / 8 + smooth * freq)
    np.testing.assert_allclose(ours, expected, rtol=1e-5)
    assert ours[-1] == pytest.approx(base[-1] / 8, rel=1e-5) and ours[0] == pytest.approx(1.0)


def test_tied_embeddings_share_one_matrix():
    cfg = config(tie_embeddings=True)
    state = nnx.state(Transformer(cfg, nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    assert "unembedding" not in params
    model = nnx.merge(nnx.graphdef(Transformer(cfg, nnx.Rngs(0))), params)
    np.testing.assert_allclose(model.output_weights(), params["embedding"].T)
