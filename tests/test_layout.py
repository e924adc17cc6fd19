"""Kernel calls in either layout (kernels/layout.py): a call on head-major [b, h, s, d]
tensors is the same attention as on [b, s, h, d] ones, transposed, for every backend,
forward, gradients and the ring's block backward; and `native_layout` names the layout
each backend computes in (what ring attention keeps its tensors in)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain import kernels
from lctrain.kernels import HEADS_MAJOR, IMPLS, TOKENS_MAJOR

B, S, HQ, HKV, D, BLOCK = 1, 256, 4, 2, 16, 128  # splash tiles in 128s even interpreted


def _inputs():
    rng = np.random.default_rng(0)
    q, dout = (jnp.asarray(rng.standard_normal((B, S, HQ, D), np.float32)) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, S, HKV, D), np.float32)) for _ in range(2))
    ids = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    segments = np.zeros((B, S), np.int32)
    segments[:, S // 3:] = 1
    return q, k, v, dout, ids, segments


def _heads_major(x):
    return jnp.swapaxes(x, 1, 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_heads_major_call_is_the_transposed_tokens_major_call(impl):
    q, k, v, dout, ids, segments = _inputs()
    options = dict(q_positions=ids, kv_positions=ids, q_segment_ids=segments,
                   kv_segment_ids=segments, impl=impl, block_q=BLOCK, block_kv=BLOCK,
                   return_lse=True)

    def run(layout, convert):
        def loss(q, k, v):
            out, lse = kernels.attention(q, k, v, layout=layout, **options)
            return jnp.sum(out * convert(dout)) + jnp.sum(jnp.sin(lse)), (out, lse)

        grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
            *map(convert, (q, k, v)))
        block = kernels.attention_block_backward(
            *map(convert, (q, k, v)), kernels.row_dot(out, convert(dout), layout), lse,
            convert(dout), **{
                key: value for key, value in options.items() if key != "return_lse"},
            layout=layout)
        return [convert(out), lse, *map(convert, grads), *map(convert, block)]

    tokens_major = jax.jit(lambda: run(TOKENS_MAJOR, lambda x: x))()
    heads_major = jax.jit(lambda: run(HEADS_MAJOR, _heads_major))()
    for got, want in zip(heads_major, tokens_major):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_native_layouts():
    """Pallas and splash tile heads-major, so ring attention keeps their tensors so; xla
    (and anything on GPU, where xla runs) stays tokens-major."""
    def layout(impl, platform):
        return kernels.native_layout(2048, 2048, impl=impl, block_q=512, block_kv=512,
                                     platform=platform, run_tokens=2048)

    assert layout("pallas", "tpu") == layout("splash", "tpu") == layout("auto", "tpu") \
        == HEADS_MAJOR
    assert layout("xla", "tpu") == layout("pallas", "gpu") == layout("auto", "cpu") \
        == TOKENS_MAJOR
