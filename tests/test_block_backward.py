"""The block backward ring attention calls per step (`kernels.attention_block_backward`):
given the rows' final out/lse it gives this kv block's share of the gradients, and it adds
them into a caller's running f32 sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels import attention


def test_block_backward_with_merged_statistics_sums_to_the_full_gradient():
    """Splitting kv in two and calling the block backward with the FULL out/lse for each
    half gives the gradient of attention over the whole kv (what ring attention does)."""
    from lctrain.kernels import TOKENS_MAJOR, attention_block_backward, row_dot

    rng = np.random.default_rng(3)
    b, s, hq, hkv, d = 1, 32, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
               for h in (hq, hkv, hkv))
    dout = jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.float32)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    seg = jnp.ones((b, s), jnp.int32)
    common = dict(q_positions=pos, q_segment_ids=seg, block_q=8, block_kv=8)
    out, lse = attention(q, k, v, kv_positions=pos, kv_segment_ids=seg, return_lse=True,
                         **common)
    _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, kv_positions=pos,
                                               kv_segment_ids=seg, **common), q, k, v)
    dq_full, dk_full, dv_full = vjp(dout)
    halves = [slice(0, s // 2), slice(s // 2, s)]
    parts = [attention_block_backward(q, k[:, h], v[:, h], row_dot(out, dout, TOKENS_MAJOR),
                                      lse, dout,
                                      kv_positions=pos[:, h], kv_segment_ids=seg[:, h], **common)
             for h in halves]
    np.testing.assert_allclose(parts[0][0] + parts[1][0], dq_full, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([parts[0][1], parts[1][1]], 1), dk_full, atol=1e-5)
    np.testing.assert_allclose(jnp.concatenate([parts[0][2], parts[1][2]], 1), dv_full, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas", "splash"])
def test_block_backward_adds_into_the_callers_f32_sums(impl):
    """With dq_sum and dkv_sum (ring attention's running sums) the block backward returns
    them plus this block's gradients, in f32: the Pallas kernel adds in its own buffers,
    the others after the call."""
    from lctrain.kernels import TOKENS_MAJOR, attention_block_backward, row_dot

    rng = np.random.default_rng(4)
    b, s, hq, hkv, d = 1, 256, 4, 2, 8
    q, k, v, dout = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
                     for h in (hq, hkv, hkv, hq))
    pos, seg = jnp.arange(s, dtype=jnp.int32)[None], jnp.ones((b, s), jnp.int32)
    ids = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
               impl=impl, block_q=128, block_kv=128)
    out, lse = attention(q, k, v, return_lse=True, **ids)
    args = (q, k, v, row_dot(out, dout, TOKENS_MAJOR), lse, dout)
    dq_sum, dk_sum, dv_sum = (jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
                              for x in (q, k, v))
    alone = attention_block_backward(*args, **ids)
    summed = attention_block_backward(*args, dq_sum=dq_sum, dkv_sum=(dk_sum, dv_sum), **ids)
    for got, total, block in zip(summed, (dq_sum, dk_sum, dv_sum), alone):
        assert got.dtype == jnp.float32
        # The kernel adds its f32 block before rounding: within a bf16 step of the block.
        np.testing.assert_allclose(got, total + block.astype(jnp.float32),
                                   atol=float(jnp.max(jnp.abs(block.astype(jnp.float32)))) / 64)
        assert float(jnp.max(jnp.abs(got - total))) > 0.1  # the block's share is there
