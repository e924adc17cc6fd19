"""Attention kernels against the dense float32 reference (tests/reference.py).

Each case compares forward out and lse, and the VJP (dq, dk, dv) under random
cotangents for BOTH out and lse, since ring attention differentiates through
lse when merging partial results. Bounds are max absolute errors.

Speed: every distinct (shape, dtype, causal, blocks) costs one XLA compile of
kernel + reference fwd/bwd (~1.5 s on a small CPU), so cases share shapes
where they can: masks are data (positions / segment ids), not shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels import IMPLS, attention, resolve_impl
from lctrain.kernels.xla import largest_divisor_at_most
from kernel_harness import assert_kernel_close, largest_intermediate
from reference import dense_attention, merge_partials

# f32: max abs error bound. Inputs are N(0, 1), so outputs, lse and grads are
# O(1-10); measured errors are ~1e-6.
F32_TOL = 1e-5
# bf16 inputs vs the f32 reference on the same (rounded) inputs: out and grads
# come back in bf16, so the error is dominated by that final rounding (half an
# ulp is 2^-9..2^-8 relative). Bound: max abs error <= BF16_REL * max |reference|;
# measured <= 7e-3. lse stays f32 (bf16 products are exact in f32): abs bound.
BF16_REL = 2e-2
BF16_LSE_TOL = 1e-4

B, HQ, D = 2, 8, 16
S, BLOCK = 96, 32  # the shared shape: 3 x 3 blocks, not a power of two


# ---------------------------------------------------------------- inputs ----
# Built with NumPy: eager jax.random / jnp ops would each compile once per
# shape, which costs more than the kernels themselves on a small CPU.

def _normal(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def _qkv(seed, sq=S, skv=S, hkv=2, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (_normal(rng, (B, sq, HQ, D), dtype), _normal(rng, (B, skv, hkv, D), dtype),
            _normal(rng, (B, skv, hkv, D), dtype))


def _arange(s, offset=0):
    return np.broadcast_to(np.arange(offset, offset + s, dtype=np.int32), (B, s))


def _one_segment(s):
    return np.zeros((B, s), np.int32)


def _packed(s, n_docs, seed):
    """(positions, segment ids) for rows packing n_docs documents each.

    Rows get different boundaries; positions restart at 0 in every document."""
    rng = np.random.default_rng(seed)
    poss, segs = [], []
    for _ in range(B):
        starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, s), n_docs - 1,
                                                         replace=False))])
        seg = np.searchsorted(starts, np.arange(s), side="right") - 1
        poss.append(np.arange(s) - starts[seg])
        segs.append(seg)
    return np.stack(poss).astype(np.int32), np.stack(segs).astype(np.int32)


def _cotangents(q_shape, seed):
    """Random cotangents for out [b, sq, hq, d] and lse [b, hq, sq] (NumPy f32).

    The lse cotangent is nonzero on every row, including rows whose lse is
    -inf: the gradient must still be finite there (and zero)."""
    b, sq, hq, d = q_shape
    rng = np.random.default_rng(1000 + seed)
    return (rng.standard_normal(q_shape, dtype=np.float32),
            rng.standard_normal((b, hq, sq), dtype=np.float32))


# ---------------------------------------------------------------- harness ----

@functools.partial(jax.jit, static_argnames=("causal", "block_q", "block_kv"))
def _kernel_and_reference(q, k, v, qp, kp, qs, ks, cot_out, cot_lse, *, causal, block_q,
                          block_kv):
    """[(out, lse, dq, dk, dv) from impl="xla", the same from the dense reference]."""
    def kernel(q, k, v):
        return attention(q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs,
                         kv_segment_ids=ks, causal=causal, impl="xla", block_q=block_q,
                         block_kv=block_kv, return_lse=True)

    def reference(q, k, v):
        return dense_attention(q, k, v, qp, kp, qs, ks, causal)

    results = []
    for fn in (kernel, reference):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        grads = vjp((cot_out.astype(out.dtype), cot_lse))
        results.append((out, lse, *grads))
    return results


def _run(q, k, v, qp, kp, qs, ks, *, causal, block_q=BLOCK, block_kv=BLOCK, seed=0,
         cotangents=None):
    """Run kernel and reference; returns (got, want) dicts of f32 NumPy arrays."""
    cot_out, cot_lse = _cotangents(q.shape, seed) if cotangents is None else cotangents
    # The kernel uses the default matmul precision (fast, reduced on TPU / TF32 on
    # GPU); full f32 here makes the f32 bounds meaningful on any backend.
    with jax.default_matmul_precision("highest"):
        got, want = _kernel_and_reference(q, k, v, qp, kp, qs, ks, cot_out, cot_lse,
                                          causal=causal, block_q=block_q,
                                          block_kv=block_kv)
    # The kernel keeps the input dtypes; the reference is f32.
    assert [x.dtype for x in got] == [q.dtype, jnp.float32, q.dtype, k.dtype, v.dtype]
    names = ("out", "lse", "dq", "dk", "dv")
    return ({n: np.asarray(x, np.float32) for n, x in zip(names, got)},
            {n: np.asarray(x, np.float32) for n, x in zip(names, want)})


def _f32_bounds(tol=F32_TOL):
    return dict.fromkeys(("out", "lse", "dq", "dk", "dv"), tol)


# ------------------------------------------------------------------ tests ----

# Non-causal GQA is covered at ratio 4 here and in the packed / sq != skv tests.
@pytest.mark.parametrize("gqa,causal", [(1, True), (2, True), (4, True), (4, False),
                                        (8, True)])
def test_gqa_ratios(gqa, causal):
    """hq = 8 query heads over 8 // gqa kv heads, s = 96 in 32-blocks; bound F32_TOL."""
    q, k, v = _qkv(gqa, hkv=HQ // gqa)
    pos, seg = _arange(S), _one_segment(S)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=causal, seed=gqa)
    assert_kernel_close(got, want, _f32_bounds())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_segments(causal):
    """Four documents per row (different per row), positions restarting per
    document; bound F32_TOL. Also checks documents really are isolated."""
    q, k, v = _qkv(10)
    pos, seg = _packed(S, n_docs=4, seed=10)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=causal)
    assert_kernel_close(got, want, _f32_bounds())
    one = _one_segment(S)
    unpacked, _ = _run(q, k, v, pos, pos, one, one, causal=causal)
    assert np.max(np.abs(got["out"] - unpacked["out"])) > 0.1


@pytest.mark.parametrize("kv_chunk", [0, 1, 2], ids=["kv0", "kv1", "diagonal"])
def test_ring_step_offsets(kv_chunk):
    """A ring step: q is chunk 2 of a 4-chunk sequence (positions 192..287), k/v are
    chunk `kv_chunk`. Earlier chunks are fully visible, the diagonal one causal.
    Bound F32_TOL."""
    q, k, v = _qkv(12 + kv_chunk)
    seg = _one_segment(S)
    got, want = _run(q, k, v, _arange(S, 2 * S), _arange(S, kv_chunk * S), seg, seg,
                     causal=True, seed=kv_chunk)
    assert_kernel_close(got, want, _f32_bounds())
    assert np.all(np.isfinite(got["lse"]))  # every query sees at least one key


def test_ring_step_future_chunk_is_fully_masked():
    """q = chunk 2, k/v = chunk 3 (later): every pair masked. Exactly out == 0,
    lse == -inf and dq == dk == dv == 0 (finite) under nonzero cotangents."""
    q, k, v = _qkv(20)
    seg = _one_segment(S)
    got, want = _run(q, k, v, _arange(S, 2 * S), _arange(S, 3 * S), seg, seg, causal=True)
    assert np.all(np.isneginf(got["lse"])) and np.all(np.isneginf(want["lse"]))
    for name in ("out", "dq", "dk", "dv"):
        assert np.all(got[name] == 0), name
    assert_kernel_close(got, want, _f32_bounds(0.0))


@jax.jit
def _ring_merged_and_reference(q, k, v, pos, seg, cot_out, cot_lse):
    """Grads of kv-chunked attention merged through lse (as ring attention does)
    and of the dense reference over all keys."""
    def merged(q, k, v):
        parts = [attention(q, kc, vc, q_positions=pos, kv_positions=pc, q_segment_ids=seg,
                           kv_segment_ids=sc, block_q=BLOCK, block_kv=16, return_lse=True)
                 for kc, vc, pc, sc in zip(*(jnp.split(x, 2, axis=1) for x in (k, v, pos, seg)))]
        return merge_partials(parts)

    def reference(q, k, v):
        return dense_attention(q, k, v, pos, pos, seg, seg)

    results = []
    for fn in (merged, reference):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        results.append((out, lse, *vjp((cot_out, cot_lse))))
    return results


def test_merge_through_lse_like_a_ring():
    """Keys split in two chunks, partial results merged with logsumexp weights and
    differentiated through lse; the first 48 queries see nothing in the second chunk
    (its lse is -inf there). Must match dense attention over all keys: F32_TOL."""
    q, k, v = _qkv(25)
    pos, seg = _packed(S, n_docs=2, seed=25)
    cot_out, cot_lse = _cotangents(q.shape, seed=25)
    with jax.default_matmul_precision("highest"):
        got, want = _ring_merged_and_reference(q, k, v, pos, seg, cot_out, cot_lse)
    names = ("out", "lse", "dq", "dk", "dv")
    got = {n: np.asarray(x) for n, x in zip(names, got)}
    want = {n: np.asarray(x) for n, x in zip(names, want)}
    assert_kernel_close(got, want, _f32_bounds())


def test_some_rows_empty():
    """Queries whose segment has no keys, and causal queries before every key, get
    out 0 / lse -inf; the other rows are unaffected. Bound F32_TOL."""
    q, k, v = _qkv(21)
    q_seg = _one_segment(S).copy()
    q_seg[:, 40:50] = 7  # segment 7 has no keys
    kv_pos = _arange(S, offset=3)  # queries at positions 0..2 precede every key
    got, want = _run(q, k, v, _arange(S), kv_pos, q_seg, _one_segment(S), causal=True)
    empty = [0, 1, 2, *range(40, 50)]
    assert np.all(np.isneginf(got["lse"][:, :, empty]))
    assert np.all(got["out"][:, empty] == 0)
    assert np.all(np.isfinite(np.delete(got["lse"], empty, axis=2)))
    assert_kernel_close(got, want, _f32_bounds())


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_load_balanced_permutation(packed):
    """Tokens stored in shuffled order, positions and segments moving with them.
    The kernel on the shuffled layout must equal the reference on the ORIGINAL
    order, then shuffled: masks come from positions, not indices. Bound F32_TOL."""
    q, k, v = _qkv(30)
    pos, seg = _packed(S, n_docs=3, seed=30) if packed else (_arange(S), _one_segment(S))
    perm = np.random.default_rng(30).permutation(S)
    cot_out, cot_lse = _cotangents(q.shape, seed=30)

    def shuffle(x, axis=1):
        return np.take(np.asarray(x), perm, axis=axis)

    got, _ = _run(*(jnp.asarray(shuffle(x)) for x in (q, k, v)), shuffle(pos), shuffle(pos),
                  shuffle(seg), shuffle(seg), causal=True, cotangents=(cot_out, cot_lse))
    # Reference in the original order, with the same cotangents un-shuffled.
    inv = np.argsort(perm)
    _, ref = _run(q, k, v, pos, pos, seg, seg, causal=True,
                  cotangents=(cot_out[:, inv], cot_lse[:, :, inv]))
    want = {n: shuffle(x, axis=2 if n == "lse" else 1) for n, x in ref.items()}
    assert_kernel_close(got, want, _f32_bounds())


def test_bf16_inputs():
    """bf16 q/k/v (packed, causal) vs the f32 reference on the same rounded inputs.
    Bounds: max abs err <= BF16_REL * max|reference| for out and grads, and
    BF16_LSE_TOL absolute for lse. out and grads come back in bf16."""
    q, k, v = _qkv(40, dtype=jnp.bfloat16)
    pos, seg = _packed(S, n_docs=2, seed=40)
    got, want = _run(q, k, v, pos, pos, seg, seg, causal=True)
    bounds = {n: BF16_REL * float(np.max(np.abs(want[n]))) for n in ("out", "dq", "dk", "dv")}
    assert_kernel_close(got, want, {**bounds, "lse": BF16_LSE_TOL})


@pytest.mark.parametrize("causal,sq,skv,block_q,block_kv", [
    (True, 64, 160, 48, 48),   # blocks round down to 32 (q) and 40 (kv)
    (False, 48, 80, 1000, 24),  # block_q > sq -> one q block of 48; kv 24 -> 20
])
def test_sq_differs_from_skv(causal, sq, skv, block_q, block_kv):
    """sq != skv, queries are the last sq positions of the keys, with requested
    blocks that do not divide the lengths. Bound F32_TOL."""
    q, k, v = _qkv(11, sq, skv, hkv=4)
    got, want = _run(q, k, v, _arange(sq, offset=skv - sq), _arange(skv), _one_segment(sq),
                     _one_segment(skv), causal=causal, block_q=block_q, block_kv=block_kv)
    assert_kernel_close(got, want, _f32_bounds())


def test_block_sizes_are_largest_divisors():
    assert largest_divisor_at_most(96, 32) == 32
    assert largest_divisor_at_most(64, 48) == 32
    assert largest_divisor_at_most(160, 48) == 40
    assert largest_divisor_at_most(80, 24) == 20
    assert largest_divisor_at_most(48, 1000) == 48
    assert largest_divisor_at_most(97, 32) == 1  # prime: correct, slow


def test_output_shapes_and_dtypes():
    """out keeps q's dtype and shape, lse is f32 [b, hq, sq]; return_lse=False gives
    out alone. (Abstract evaluation: no compile.)"""
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _qkv(0, 32, 64))
    kw = dict(q_positions=_arange(32), kv_positions=_arange(64),
              q_segment_ids=_one_segment(32), kv_segment_ids=_one_segment(64))
    out, lse = jax.eval_shape(functools.partial(attention, return_lse=True, **kw), q, k, v)
    assert (out.shape, out.dtype) == (q.shape, jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((B, HQ, 32), jnp.float32)
    out_only = jax.eval_shape(functools.partial(attention, **kw), q, k, v)
    assert (out_only.shape, out_only.dtype) == (q.shape, jnp.bfloat16)


def test_memory_is_blockwise():
    """Forward + backward never materialize a [sq, skv] score matrix: with s = 512 and
    32-blocks the largest intermediate is < 1/8 of b*hq*s*s, while the dense
    reference does reach it (sanity check of the probe). Tracing only."""
    s = 512
    q, k, v = _qkv(70, s, s)
    pos, seg = _arange(s), _one_segment(s)

    def grad_of(fn):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jax.grad(loss, argnums=(0, 1, 2))

    kernel = grad_of(lambda q, k, v: attention(
        q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
        block_q=32, block_kv=32, return_lse=True))
    reference = grad_of(lambda q, k, v: dense_attention(q, k, v, pos, pos, seg, seg))
    full_scores = B * HQ * s * s
    assert largest_intermediate(jax.make_jaxpr(kernel)(q, k, v).jaxpr) < full_scores // 8
    assert largest_intermediate(jax.make_jaxpr(reference)(q, k, v).jaxpr) >= full_scores


def test_the_recipe_offers_the_registered_kernels_and_auto():
    import typing

    from lctrain.recipes.schema import AttentionConfig
    choices = typing.get_args(typing.get_type_hints(AttentionConfig)["impl"])
    assert set(choices) == {*IMPLS, "auto"}


def test_auto_impl_resolves_to_a_registered_backend():
    """"auto" (recipe option) picks a registered impl; on CPU that is xla."""
    assert resolve_impl("auto") in IMPLS
    if jax.default_backend() == "cpu":
        assert resolve_impl("auto") == "xla"
    q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _qkv(0, 32, 32))
    kw = dict(q_positions=_arange(32), kv_positions=_arange(32),
              q_segment_ids=_one_segment(32), kv_segment_ids=_one_segment(32))
    out = jax.eval_shape(functools.partial(attention, impl="auto", **kw), q, k, v)
    assert out.shape == q.shape


def test_unknown_impl_and_bad_shapes_raise():
    q, k, v = _qkv(80, 32, 32)
    kw = dict(q_positions=_arange(32), kv_positions=_arange(32),
              q_segment_ids=_one_segment(32), kv_segment_ids=_one_segment(32))
    with pytest.raises(ValueError, match="allowed: .*'xla'"):
        attention(q, k, v, impl="nope", **kw)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), **kw)
    with pytest.raises(ValueError, match="kv_positions"):
        attention(q, k, v, **{**kw, "kv_positions": _arange(31)})


@pytest.mark.parametrize("chip, tokens, pinned, want", [
    ("v5e", 8192, [], ("pallas", 1024, 1024)),      # splash's dq kernel: VMEM at 1024
    ("v5e", 65536, [], ("pallas", 512, 2048)),
    ("v5e", 65536, ["attention.block_q=256"], ("pallas", 256, 2048)),
    ("v5e", 65536, ["attention.impl=splash"], ("splash", 512, 512)),
    ("v5p", 65536, [], ("auto", 512, 512)),         # not timed: the kernels' own defaults
    (None, 65536, [], ("auto", 512, 512)),
])
def test_unset_attention_takes_the_chips_measured_kernel_and_blocks(chip, tokens, pinned, want):
    """kernels/tiles.py's rows as a recipe gets them: what it pins stays pinned."""
    from lctrain.parallel import attention_on
    from lctrain.recipes import load_recipe

    recipe = load_recipe("tiny", [f"data.seq_len={2 * tokens}", *pinned])
    a = attention_on(recipe, chip, sequence_shards=2)
    assert (a.impl, a.block_q, a.block_kv) == want


def test_a_v5e_strategy_calls_the_kernel_with_the_measured_blocks():
    """The strategy hands kernels.attention what attention_on resolved for its devices'
    chip (an AOT v5e device: its device_kind is the chip's)."""
    from types import SimpleNamespace

    from lctrain.parallel import NoContextParallel
    from lctrain.recipes import load_recipe

    device = SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")
    mesh = SimpleNamespace(devices=np.array([device]).reshape(1, 1, 1, 1, 1),
                           shape={"data": 1, "fsdp": 1, "context": 1, "ulysses": 1, "tensor": 1})
    strategy = NoContextParallel(load_recipe("tiny", ["data.seq_len=32768"]), mesh)
    assert (strategy.kernel_options["impl"], strategy.kernel_options["block_q"],
            strategy.kernel_options["block_kv"]) == ("pallas", 512, 2048)
