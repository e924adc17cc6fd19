"""Attention kernels against the dense float32 reference.

Each case compares forward out and lse, and the VJP (dq, dk, dv) under random
cotangents for BOTH out and lse, since ring attention differentiates through
lse when merging partial results. Error bounds are max absolute errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels import IMPLS, attention
from lctrain.kernels.xla import largest_divisor_at_most
from reference import dense_attention

# Max abs error bounds. Inputs are N(0, 1), so scores, outputs and grads are O(1);
# measured f32 errors are ~1e-6, bf16 (inputs rounded, bf16 matmuls with f32
# accumulation, vs the f32 reference on the same rounded inputs) ~1e-2.
F32_TOL = 1e-5
BF16_OUT_TOL = 2e-2
BF16_LSE_TOL = 2e-2
BF16_GRAD_TOL = 6e-2

B, HQ, D = 2, 8, 16


# ---------------------------------------------------------------- helpers ----

def _qkv(seed, sq, skv, hq=HQ, hkv=2, d=D, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, sq, hq, d), jnp.float32)
    k = jax.random.normal(kk, (B, skv, hkv, d), jnp.float32)
    v = jax.random.normal(kv, (B, skv, hkv, d), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _arange(s, offset=0):
    return jnp.broadcast_to(jnp.arange(offset, offset + s, dtype=jnp.int32), (B, s))


def _single_segment(s):
    return jnp.zeros((B, s), jnp.int32)


def _packed(s, n_docs, seed):
    """Segment ids and per-document positions for rows packing n_docs documents."""
    rng = np.random.default_rng(seed)
    segs, poss = [], []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, s), n_docs - 1, replace=False))
        seg = np.zeros(s, np.int32)
        seg[cuts] = 1
        seg = np.cumsum(seg).astype(np.int32)
        starts = np.concatenate([[0], cuts])
        segs.append(seg)
        poss.append(np.arange(s) - starts[seg])  # positions restart per document
    return jnp.asarray(np.stack(poss), jnp.int32), jnp.asarray(np.stack(segs), jnp.int32)


@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_kv"))
def _kernel_and_reference(q, k, v, qp, kp, qs, ks, cot_out, cot_lse, *, causal, block_q,
                          block_kv):
    """((out, lse, dq, dk, dv) from impl="xla", same from the dense reference)."""
    def kernel(q, k, v):
        return attention(q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs,
                         kv_segment_ids=ks, causal=causal, impl="xla", block_q=block_q,
                         block_kv=block_kv, return_lse=True)

    def reference(q, k, v):
        return dense_attention(q, k, v, qp, kp, qs, ks, causal)

    results = []
    for fn in (kernel, reference):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        # The cotangents are cast to the output dtype (bf16 kernel vs f32 reference).
        grads = vjp((cot_out.astype(out.dtype), cot_lse))
        results.append((out, lse, *grads))
    return results


def _cotangents(q_shape, seed):
    """Random cotangents for out [b, sq, hq, d] and lse [b, hq, sq].

    The lse cotangent is nonzero on every row, including rows whose lse is
    -inf: the gradient there must still be finite (and zero)."""
    b, sq, hq, d = q_shape
    kc1, kc2 = jax.random.split(jax.random.PRNGKey(1000 + seed))
    return (jax.random.normal(kc1, q_shape, jnp.float32),
            jax.random.normal(kc2, (b, hq, sq), jnp.float32))


def _run(q, k, v, qp, kp, qs, ks, *, causal, block_q=32, block_kv=32, seed=0):
    cot_out, cot_lse = _cotangents(q.shape, seed)
    got, want = _kernel_and_reference(q, k, v, qp, kp, qs, ks, cot_out, cot_lse,
                                      causal=causal, block_q=block_q, block_kv=block_kv)
    names = ("out", "lse", "dq", "dk", "dv")
    return ({n: np.asarray(x, np.float32) for n, x in zip(names, got)},
            {n: np.asarray(x, np.float32) for n, x in zip(names, want)})


def _max_err(got, want):
    """Max abs error; -inf entries (empty rows' lse) must coincide exactly."""
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "empty rows differ"
    finite = np.isfinite(want)
    assert np.all(np.isfinite(got[finite])), "kernel produced non-finite values"
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))


def _assert_close(got, want, tol, grad_tol=None, lse_tol=None):
    grad_tol = tol if grad_tol is None else grad_tol
    lse_tol = tol if lse_tol is None else lse_tol
    for name in ("out", "dq", "dk", "dv"):  # these are finite everywhere
        assert np.all(np.isfinite(got[name])), f"{name} has NaN/inf"
    errors = {n: _max_err(got[n], want[n]) for n in got}
    bounds = {"out": tol, "lse": lse_tol, "dq": grad_tol, "dk": grad_tol, "dv": grad_tol}
    bad = {n: (errors[n], bounds[n]) for n in errors if not errors[n] <= bounds[n]}
    assert not bad, f"max abs error above bound (err, bound): {bad}"
    return errors


# ------------------------------------------------------------------ tests ----

@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_matches_reference_gqa(causal, gqa):
    """sq = skv = 96 with 32-blocks (3 x 3 blocks, not a power of two); bound F32_TOL."""
    q, k, v = _qkv(gqa, 96, 96, hkv=HQ // gqa)
    pos, seg = _arange(96), _single_segment(96)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=causal, seed=gqa)
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_segments(causal):
    """Four documents per row, positions restarting per document; bound F32_TOL."""
    q, k, v = _qkv(10, 96, 96)
    pos, seg = _packed(96, n_docs=4, seed=10)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=causal)
    _assert_close(got, want, F32_TOL)
    # Documents really are isolated: the output is not the single-segment one.
    single = _single_segment(96)
    got_single, _ = _run(q, k, v, pos, pos, single, single, causal=causal)
    assert np.max(np.abs(got["out"] - got_single["out"])) > 1e-2


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sq_differs_from_skv(causal):
    """sq = 64 queries are the last 64 positions of skv = 160 keys (block_kv = 32 -> 5
    kv blocks, block_q = 32 -> 2 q blocks); bound F32_TOL."""
    q, k, v = _qkv(11, 64, 160, hkv=4)
    got, want = _run(q, k, v, _arange(64, offset=96), _arange(160), _single_segment(64),
                     _single_segment(160), causal=causal)
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("kv_chunk", [0, 1, 2], ids=["kv0", "kv1", "diag"])
def test_ring_step_offsets(kv_chunk):
    """A ring step: q is chunk 2 of a 4-chunk sequence, k/v are chunk `kv_chunk`.
    Earlier chunks are fully visible, the diagonal is causal; bound F32_TOL."""
    c = 48
    q, k, v = _qkv(12 + kv_chunk, c, c)
    qp, kp = _arange(c, offset=2 * c), _arange(c, offset=kv_chunk * c)
    seg = _single_segment(c)
    got, want = _run(q, k, v, qp, kp, seg, seg, causal=True, block_q=16, block_kv=16)
    _assert_close(got, want, F32_TOL)
    assert np.all(np.isfinite(got["lse"]))  # every query sees at least one key


def test_ring_step_future_chunk_is_fully_masked():
    """q = chunk 2, k/v = chunk 3 (later): every pair masked. Exact: out == 0,
    lse == -inf, grads == 0 (finite) even with nonzero cotangents everywhere."""
    c = 48
    q, k, v = _qkv(20, c, c)
    seg = _single_segment(c)
    got, want = _run(q, k, v, _arange(c, offset=2 * c), _arange(c, offset=3 * c), seg, seg,
                     causal=True, block_q=16, block_kv=16)
    assert np.all(got["out"] == 0)
    assert np.all(np.isneginf(got["lse"])) and np.all(np.isneginf(want["lse"]))
    for name in ("dq", "dk", "dv"):
        assert np.all(got[name] == 0), name
    _assert_close(got, want, 0.0)


def test_some_rows_empty():
    """Queries whose segment id appears in no key (and causal rows before every key)
    get out 0 / lse -inf; the other rows are unaffected. Bound F32_TOL."""
    q, k, v = _qkv(21, 64, 64)
    qs = _single_segment(64).at[:, 5:9].set(7)  # segment 7 has no keys
    kp = _arange(64, offset=3)  # queries at positions 0..2 precede every key
    got, want = _run(q, k, v, _arange(64), kp, qs, _single_segment(64), causal=True)
    assert np.all(np.isneginf(got["lse"][:, :, [0, 1, 2, 5, 6, 7, 8]]))
    assert np.all(got["out"][:, [0, 1, 2, 5, 6, 7, 8]] == 0)
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_load_balanced_permutation(packed):
    """Tokens stored in a shuffled order (positions and segments move with them).
    The kernel on the permuted layout must equal the dense reference on the
    ORIGINAL order, permuted: masks come from positions, not indices. Bound F32_TOL."""
    s = 96
    q, k, v = _qkv(30, s, s)
    pos, seg = _packed(s, n_docs=3, seed=30) if packed else (_arange(s), _single_segment(s))
    perm = jnp.asarray(np.random.default_rng(30).permutation(s))
    take = lambda x, axis=1: jnp.take(x, perm, axis=axis)  # noqa: E731
    got, _ = _run(*map(take, (q, k, v, pos, pos, seg, seg)), causal=True, seed=30)

    # Reference in the original order, with the kernel's cotangents un-permuted.
    cot_out, cot_lse = _cotangents(q.shape, seed=30)
    inv = jnp.argsort(perm)
    (out, lse), vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, pos, pos, seg, seg),
                              q, k, v)
    dq, dk, dv = vjp((jnp.take(cot_out, inv, axis=1), jnp.take(cot_lse, inv, axis=2)))
    want = {"out": take(out), "lse": take(lse, axis=2), "dq": take(dq), "dk": take(dk),
            "dv": take(dv)}
    want = {n: np.asarray(x) for n, x in want.items()}
    _assert_close(got, want, F32_TOL)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_bf16_inputs(causal):
    """bf16 q/k/v vs the f32 reference on the same (rounded) inputs. out is bf16;
    bounds BF16_OUT_TOL (out), BF16_LSE_TOL (lse), BF16_GRAD_TOL (grads)."""
    q, k, v = _qkv(40, 96, 96, dtype=jnp.bfloat16)
    pos, seg = _packed(96, n_docs=2, seed=40)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=causal)
    _assert_close(got, want, BF16_OUT_TOL, grad_tol=BF16_GRAD_TOL, lse_tol=BF16_LSE_TOL)


def test_dtypes_and_return_lse_false():
    """out keeps q's dtype, lse is f32 [b, hq, sq]; return_lse=False gives out alone."""
    q, k, v = _qkv(50, 32, 32, dtype=jnp.bfloat16)
    kw = dict(q_positions=_arange(32), kv_positions=_arange(32),
              q_segment_ids=_single_segment(32), kv_segment_ids=_single_segment(32),
              block_q=16, block_kv=16)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (B, HQ, 32)
    out_only = attention(q, k, v, **kw)
    assert np.array_equal(np.asarray(out_only, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("sq,skv,block_q,block_kv", [(90, 90, 32, 32), (48, 80, 1000, 24)])
def test_blocks_round_down_to_divisors(sq, skv, block_q, block_kv):
    """Requested blocks that do not divide the length fall back to the largest divisor
    (90 -> 30; 80 with 24 -> 20; 1000 > 48 -> 48); results still within F32_TOL."""
    assert largest_divisor_at_most(90, 32) == 30
    assert largest_divisor_at_most(80, 24) == 20
    assert largest_divisor_at_most(48, 1000) == 48
    q, k, v = _qkv(60, sq, skv, hkv=4)
    got, want = _run(q, k, v, _arange(sq, offset=skv - sq), _arange(skv), _single_segment(sq),
                     _single_segment(skv), causal=True, block_q=block_q, block_kv=block_kv)
    _assert_close(got, want, F32_TOL)


def _largest_intermediate(jaxpr):
    """Largest array (in elements) produced anywhere in a jaxpr, sub-jaxprs included."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    biggest = max(biggest, _largest_intermediate(sub))
    return biggest


def test_memory_is_blockwise():
    """Forward + backward never materialize a [sq, skv] score matrix: with s = 512 and
    32-blocks the largest intermediate is < 1/8 of b*hq*s*s (the dense reference's
    scores), while the reference does materialize it (sanity check of the probe)."""
    s = 512
    q, k, v = _qkv(70, s, s)
    pos, seg = _arange(s), _single_segment(s)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jax.grad(f, argnums=(0, 1, 2))

    kernel = loss(lambda q, k, v: attention(
        q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
        block_q=32, block_kv=32, return_lse=True))
    reference = loss(lambda q, k, v: dense_attention(q, k, v, pos, pos, seg, seg))
    full_scores = B * HQ * s * s
    assert _largest_intermediate(jax.make_jaxpr(kernel)(q, k, v).jaxpr) < full_scores // 8
    assert _largest_intermediate(jax.make_jaxpr(reference)(q, k, v).jaxpr) >= full_scores


def test_unknown_impl_and_bad_shapes_raise():
    q, k, v = _qkv(80, 32, 32)
    kw = dict(q_positions=_arange(32), kv_positions=_arange(32),
              q_segment_ids=_single_segment(32), kv_segment_ids=_single_segment(32))
    assert IMPLS == ("xla",)
    with pytest.raises(ValueError, match="xla"):
        attention(q, k, v, impl="nope", **kw)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), **kw)
    with pytest.raises(ValueError, match="kv_positions"):
        attention(q, k, v, **{**kw, "kv_positions": _arange(31)})
