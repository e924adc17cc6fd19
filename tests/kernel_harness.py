"""Shared harness for kernel tests: inputs, one compiled (kernel, dense reference) pair with
their VJPs, and error bounds. Each case compares forward out and lse and the VJP (dq, dk,
dv) under random cotangents for BOTH out and lse. Bounds are max absolute errors; inputs
are N(0, 1), so values are O(1-10) and f32 errors ~1e-6.

Speed: interpret-mode kernels are big XLA loops, so every distinct (shapes, dtype, causal,
blocks) is compiled once, with XLA's cheap optimization level (the loops run in
milliseconds; full optimization would triple compile time). Masks are data (positions
and segment ids), so most cases share one compiled shape.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels import TOKENS_MAJOR, attention, row_dot
from lctrain.kernels.jaxpr_walk import equations
from helpers import FAST_COMPILE, assert_close
from reference import dense_attention, merge_partials

# f32: max abs error bound for out, lse, dq, dk, dv (measured <= 3e-6).
F32_TOL = 1e-5
# bf16 inputs vs the f32 reference on the same rounded inputs: out and grads come back
# in bf16, so the final rounding dominates. Bound: max abs err <= BF16_REL * max|ref|
# (measured <= 4e-3); lse stays f32: absolute bound (measured 5e-7).
BF16_REL = 2e-2
BF16_LSE_TOL = 1e-4

NAMES = ("out", "lse", "dq", "dk", "dv")

_EXECUTABLES = {}


def compiled(fn, *args, **static):
    """jit(fn)(*args, **static), compiled once per (fn, static args, argument shapes)."""
    key = (fn, tuple(sorted(static.items())),
           tuple((np.shape(a), a.dtype) for a in args))
    if key not in _EXECUTABLES:
        lowered = jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static)
        # The fast options are XLA:CPU's; on a TPU (the kernels compiled by Mosaic) none.
        options = FAST_COMPILE if jax.default_backend() == "cpu" else None
        _EXECUTABLES[key] = lowered.compile(compiler_options=options)
    return _EXECUTABLES[key](*args)


def _normal(rng, shape, dtype=jnp.float32):
    # NumPy, not eager jax ops: each eager op would compile once per shape.
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def _kernel_and_reference(q, k, v, qp, kp, qs, ks, cot_out, cot_lse, *, impl, causal, block_q,
                          block_kv, window=None):
    """[(out, lse, dq, dk, dv) of `impl`, the same of the dense reference]."""
    def kernel(q, k, v):
        return attention(q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=qs,
                         kv_segment_ids=ks, causal=causal, impl=impl, block_q=block_q,
                         block_kv=block_kv, return_lse=True, window=window)

    def reference(q, k, v):
        return dense_attention(q, k, v, qp, kp, qs, ks, causal, window)

    results = []
    for fn in (kernel, reference):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        results.append((out, lse, *vjp((cot_out.astype(out.dtype), cot_lse))))
    return results


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel (`impl`) at one shape: batch b, sequence s in blocks of `block` (kv
    blocks of `block_kv` if given), hq query heads of dim d."""
    impl: str
    b: int
    s: int
    hq: int
    d: int
    block: int
    block_kv: int | None = None

    def qkv(self, seed, hkv=2, dtype=jnp.float32):
        rng = np.random.default_rng(seed)
        return (_normal(rng, (self.b, self.s, self.hq, self.d), dtype),
                _normal(rng, (self.b, self.s, hkv, self.d), dtype),
                _normal(rng, (self.b, self.s, hkv, self.d), dtype))

    def arange(self, offset=0):
        return np.broadcast_to(np.arange(offset, offset + self.s, dtype=np.int32),
                               (self.b, self.s)).copy()

    def one_segment(self):
        return np.zeros((self.b, self.s), np.int32)

    def packed(self, n_docs, seed):
        """(positions, segment ids) packing n_docs documents per row, different
        boundaries per row; positions restart at 0 in every document."""
        rng = np.random.default_rng(seed)
        poss, segs = [], []
        for _ in range(self.b):
            starts = np.sort(rng.choice(np.arange(1, self.s), n_docs - 1, replace=False))
            seg = np.searchsorted(starts, np.arange(self.s), side="right")
            poss.append(np.arange(self.s) - np.concatenate([[0], starts])[seg])
            segs.append(seg)
        return np.stack(poss).astype(np.int32), np.stack(segs).astype(np.int32)

    def cotangents(self, seed):
        """Cotangents for out [b, sq, hq, d] and lse [b, hq, sq]; nonzero on every row,
        including rows whose lse is -inf (their gradient must still be finite: zero)."""
        rng = np.random.default_rng(1000 + seed)
        return (rng.standard_normal((self.b, self.s, self.hq, self.d), dtype=np.float32),
                rng.standard_normal((self.b, self.hq, self.s), dtype=np.float32))

    def run(self, q, k, v, qp, kp, qs, ks, *, causal=True, seed=0, cotangents=None,
            window=None):
        """(got, want): dicts name -> f32 NumPy array, kernel and reference (sliding
        `window`: kernels/masks.py)."""
        cot_out, cot_lse = self.cotangents(seed) if cotangents is None else cotangents
        got, want = compiled(_kernel_and_reference, q, k, v, qp, kp, qs, ks, cot_out, cot_lse,
                             impl=self.impl, causal=causal, block_q=self.block,
                             block_kv=self.block_kv or self.block, window=window)
        assert [x.dtype for x in got] == [q.dtype, jnp.float32, q.dtype, k.dtype, v.dtype]
        return ({n: np.asarray(x, np.float32) for n, x in zip(NAMES, got)},
                {n: np.asarray(x, np.float32) for n, x in zip(NAMES, want)})


def max_err(got, want):
    """Max abs error; -inf entries (empty rows' lse) must coincide exactly."""
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "empty rows differ"
    finite = np.isfinite(want)
    assert np.all(np.isfinite(got[finite])), "kernel produced non-finite values"
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))


def assert_kernel_close(got, want, bounds=None):
    """max abs error <= bounds[name] (default F32_TOL) for out, lse, dq, dk, dv."""
    for name in ("out", "dq", "dk", "dv"):  # finite everywhere, even on empty rows
        assert np.all(np.isfinite(got[name])), f"{name} has NaN/inf"
    assert_close(got, want, dict.fromkeys(NAMES, F32_TOL) if bounds is None else bounds)


def bf16_bounds(want):
    """BF16_REL of the reference's largest value for out and grads, BF16_LSE_TOL for lse."""
    bounds = {n: BF16_REL * float(np.max(np.abs(want[n]))) for n in ("out", "dq", "dk", "dv")}
    return {**bounds, "lse": BF16_LSE_TOL}


def kv_halves(q, k, v, pos, seg, cot_out, cot_lse, *, kernel, block):
    """Attention over two kv halves, as ring attention uses a kernel module (`kernel`:
    flash_attention and flash_attention_backward), and the dense reference over all keys.
    Returns (merged, reference, block_backward, reference with zero lse cotangent), each
    (out, lse, dq, dk, dv):
      merged: halves' (out, lse) merged with logsumexp weights, its VJP (differentiates
        through each half's lse);
      block_backward: flash_attention_backward of each half given the FINAL out/lse,
        dq summed and dk, dv concatenated over the halves (lse cotangent 0)."""
    halves = [jnp.split(x, 2, axis=1) for x in (k, v, pos, seg)]
    blocks = dict(block_q=block, block_kv=block)

    def merged(q, k, v):
        parts = [kernel.flash_attention(q, kh, vh, pos, ph, seg, sh, **blocks)
                 for kh, vh, ph, sh in zip(*(jnp.split(x, 2, axis=1) for x in (k, v)),
                                           *halves[2:])]
        return merge_partials(parts)

    def reference(q, k, v):
        return dense_attention(q, k, v, pos, pos, seg, seg)

    results = []
    for fn in (merged, reference):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        results.append((out, lse, *vjp((cot_out, cot_lse))))
    (out, lse), vjp = jax.vjp(reference, q, k, v)
    reference_no_dlse = (out, lse, *vjp((cot_out, jnp.zeros_like(cot_lse))))

    out, lse = kernel.flash_attention(q, k, v, pos, pos, seg, seg, **blocks)
    delta = row_dot(out, cot_out, TOKENS_MAJOR)
    grads = [kernel.flash_attention_backward(q, kh, vh, delta, lse, cot_out, pos, ph, seg, sh,
                                             causal=True, **blocks)
             for kh, vh, ph, sh in zip(*halves)]
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads
    block_backward = (out, lse, dq0 + dq1, jnp.concatenate([dk0, dk1], axis=1),
                      jnp.concatenate([dv0, dv1], axis=1))
    return (*results, block_backward, reference_no_dlse)


def check_kv_halves(kernel, case, seed, pos, seg):
    """kv_halves under `case`'s shapes: both results within F32_TOL of the reference."""
    q, k, v = case.qkv(seed)
    cot_out, cot_lse = case.cotangents(seed)
    merged, reference, block_backward, reference_no_dlse = (
        {n: np.asarray(x) for n, x in zip(NAMES, result)}
        for result in compiled(kv_halves, q, k, v, pos, seg, cot_out, cot_lse,
                               kernel=kernel, block=case.block))
    assert_kernel_close(merged, reference)
    assert_kernel_close(block_backward, reference_no_dlse)


def compiled_for_four_v5p_chips(kernel, check_vma):
    """HLO text of forward + backward (bf16, b=1, s=8192 per chip, 8 query heads over 2 kv
    heads, d=128, blocks 512) and the ring-style block backward of a kernel module,
    compiled for a 4-chip TPU v5p inside a shard_map (libtpu ahead-of-time, no TPU)."""
    pytest.importorskip("libtpu", reason="TPU AOT compiles need libtpu (the tpu extra)")
    from jax.sharding import NamedSharding, PartitionSpec

    from lctrain.parallel import aot

    mesh = jax.sharding.Mesh(np.array(aot.topology_devices("v5p:2x2x1")).reshape(4), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    b, s, hq, hkv, d = 1, 8192, 8, 2, 128
    options = dict(causal=True, block_q=512, block_kv=512, platform="tpu")

    def per_chip(q, k, v, pos, seg, cot_out, cot_lse):
        def fn(q, k, v):
            return kernel.flash_attention(q, k, v, pos, pos, seg, seg, **options)
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        delta = row_dot(out, cot_out, TOKENS_MAJOR)
        block_grads = kernel.flash_attention_backward(q, k, v, delta, lse, cot_out, pos, pos,
                                                      seg, seg, **options)
        return out, lse, *vjp((cot_out, cot_lse)), *block_grads

    spec = PartitionSpec("x")
    sharded = jax.shard_map(per_chip, mesh=mesh, in_specs=spec, out_specs=spec,
                            check_vma=check_vma)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct((4 * shape[0], *shape[1:]), dtype,
                                    sharding=NamedSharding(mesh, spec))

    args = (arg((b, s, hq, d), jnp.bfloat16), arg((b, s, hkv, d), jnp.bfloat16),
            arg((b, s, hkv, d), jnp.bfloat16), arg((b, s), jnp.int32),
            arg((b, s), jnp.int32), arg((b, s, hq, d), jnp.bfloat16),
            arg((b, hq, s), jnp.float32))
    return jax.jit(sharded).lower(*args).compile().as_text()


def largest_intermediate(jaxpr) -> int:
    """Largest array (elements) anywhere in a jaxpr, sub-jaxprs and kernel bodies included."""
    return max((int(np.prod(getattr(var.aval, "shape", ())))
                for eqn, _ in equations(jaxpr) for var in eqn.outvars), default=0)


def kernel_call_names(impl: str, case: "KernelCase") -> set[str]:
    """The Pallas kernels kernels.attention(impl=...) calls for `case`'s shapes, forward and
    backward (traced only)."""
    q, k, v = case.qkv(0)
    positions, segments = case.arange(), case.one_segment()

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, q_positions=positions, kv_positions=positions,
                                 q_segment_ids=segments, kv_segment_ids=segments, causal=True,
                                 impl=impl, block_q=case.block, block_kv=case.block))

    return {str(eqn.params.get("name_and_src_info", eqn.params.get("name"))).split()[0]
            for eqn, _ in equations(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr)
            if eqn.primitive.name == "pallas_call"}
