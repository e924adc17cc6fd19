"""Sliding-window attention (kernels/masks.py) in every kernel, against the dense f32
reference with the same window (tests/reference.py): forward out and lse, and the VJP
under out and lse cotangents (kernel_harness). Pallas runs in interpret mode on CPU.

Shapes: s = 96 in 32-blocks (3 x 3 blocks). Windows: 8 (smaller than a block), 40 (not
a multiple of one), 64 (two blocks) and 96 = s (every causal key: equals global). The
window is a static argument, so each (kernel, window) compiles once; the layouts are
data and share it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_harness import F32_TOL, KernelCase, assert_kernel_close, max_err
from lctrain.kernels import attention, impl_for_call
from lctrain.kernels.masks import every_key_visible, pair_allowed, some_keys_visible
from lctrain.parallel.strategy import load_balanced_order

BLOCK = 32
CASES = {impl: KernelCase(impl=impl, b=2, s=96, hq=8, d=16, block=BLOCK)
         for impl in ("xla", "pallas", "triton")}
S = 96
WINDOWS = [8, 40, 64]


def _layout(case, name):
    """(positions, segment ids) of a layout: one document in order, four packed
    documents with positions restarting, or three packed documents stored in the
    load-balanced order of 3-way context parallelism (chunks of 16, two per block)."""
    if name == "in_order":
        return case.arange(), case.one_segment()
    if name == "packed":
        return case.packed(n_docs=4, seed=10)
    pos, seg = case.packed(n_docs=3, seed=30)
    order = load_balanced_order(S, 3)
    return pos[:, order], seg[:, order]


@pytest.mark.parametrize("layout", ["in_order", "packed", "load_balanced"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("impl", ["xla", "pallas", "triton"])
def test_windowed_kernel_matches_dense(impl, window, layout):
    """out, lse, dq, dk, dv within F32_TOL of dense attention with the window."""
    case = CASES[impl]
    q, k, v = case.qkv(window)
    pos, seg = _layout(case, layout)
    assert_kernel_close(*case.run(q, k, v, pos, pos, seg, seg, seed=window, window=window))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_window_of_the_whole_sequence_is_global(impl):
    """window = s admits every causal key: the result equals global attention's
    reference (packed documents). F32_TOL."""
    case = CASES[impl]
    q, k, v = case.qkv(5)
    pos, seg = case.packed(n_docs=2, seed=5)
    got, _ = case.run(q, k, v, pos, pos, seg, seg, seed=5, window=S)
    _, global_reference = case.run(q, k, v, pos, pos, seg, seg, seed=5)
    assert_kernel_close(got, global_reference)


@pytest.mark.parametrize("impl", ["pallas", "triton"])
def test_pallas_kernels_skip_blocks_outside_the_window(impl):
    """Window 8, one document in order: q block 2 (positions 64..95) sees keys from 57
    on, so kv block 0 is outside its window and must be skipped, not masked: NaN keys
    and values there do not reach q block 2's out, lse or dq (0 * NaN would)."""
    case = CASES[impl]
    q, k, v = case.qkv(22)
    pos, seg = case.arange(), case.one_segment()
    k_nan, v_nan = (x.at[:, :BLOCK].set(jnp.nan) for x in (k, v))
    got, _ = case.run(q, k_nan, v_nan, pos, pos, seg, seg, seed=22, window=8)
    _, want = case.run(q, k, v, pos, pos, seg, seg, seed=22, window=8)
    rows = slice(2 * BLOCK, 3 * BLOCK)
    assert max_err(got["out"][:, rows], want["out"][:, rows]) <= F32_TOL
    assert max_err(got["lse"][:, :, rows], want["lse"][:, :, rows]) <= F32_TOL
    assert max_err(got["dq"][:, rows], want["dq"][:, rows]) <= F32_TOL


def test_ring_step_outside_the_window_is_empty():
    """A ring step whose keys (chunk 0) all lie 64+ positions behind the queries (chunk
    2) under window 64: every row empty, out 0, lse -inf, zero gradients (xla)."""
    case = CASES["xla"]
    q, k, v = case.qkv(3)
    seg = case.one_segment()
    got, want = case.run(q, k, v, case.arange(offset=2 * S), case.arange(), seg, seg,
                         seed=3, window=64)
    assert np.all(np.isneginf(got["lse"]))
    assert all(np.all(got[name] == 0) for name in ("out", "dq", "dk", "dv"))


def test_splash_has_no_window():
    """auto on TPU takes the Pallas kernel for windowed calls (splash otherwise);
    explicit splash with a window raises, naming the fix; a bad window raises."""
    args = ("tpu", 1024, 1024, 512, 512, 1024)
    assert impl_for_call("auto", *args) == "splash"
    assert impl_for_call("auto", *args, window=256) == "pallas"
    with pytest.raises(ValueError, match="impl=pallas or auto"):
        impl_for_call("splash", *args, window=256)
    x = jnp.zeros((1, 32, 2, 16))
    ids = np.zeros((1, 32), np.int32)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="window"):
            jax.eval_shape(lambda x: attention(x, x, x, q_positions=ids, kv_positions=ids,
                                               q_segment_ids=ids, kv_segment_ids=ids,
                                               window=bad), x)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, 5), (False, None)])
def test_block_visibility_is_the_element_rule_over_the_block(causal, window):
    """The one block rule (kernels/masks.py) that the Pallas schedule, the splash block map,
    the ring's step skipping and the GPU kernel use, against the rule written out here over
    every pair of the two blocks (key not after the query if causal, fewer than `window`
    positions behind it): on runs of consecutive positions (as blocks of one document hold)
    `some` is exactly "any pair allowed" and `every` exactly "all pairs allowed"; the
    element rule (pair_allowed) is the rule itself."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        q_lo, kv_lo = rng.integers(0, 24, 2)
        q = np.arange(q_lo, q_lo + rng.integers(1, 6))
        kv = np.arange(kv_lo, kv_lo + rng.integers(1, 6))
        behind = q[:, None] - kv[None]
        allowed = np.ones(behind.shape, bool)
        if causal:
            allowed &= behind >= 0
        if window is not None:
            allowed &= behind < window
        one_document = np.zeros(behind.shape, np.int32)
        assert np.array_equal(pair_allowed(q[:, None], kv[None], one_document, one_document,
                                           causal, window), allowed)
        bounds = (q.min(), q.max(), kv.min(), kv.max())
        assert bool(some_keys_visible(*bounds, causal, window)) == allowed.any(), (q, kv)
        assert bool(every_key_visible(*bounds, causal, window)) == allowed.all(), (q, kv)
