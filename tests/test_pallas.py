"""Our two Pallas flash-attention kernels against the dense f32 reference: kernels/pallas.py
(TPU, through Mosaic) and kernels/triton.py (NVIDIA GPUs, through Triton). The cases
that say what any blockwise kernel must do run on both (the `case` fixture).

On CPU the kernels run in Pallas interpret mode: the same kernel bodies, grids, block
specs and block skipping as on the accelerator, executed by XLA. The comparison, bounds
and compile caching are tests/kernel_harness.py's.

The last test (marked slow) compiles forward + backward for a real TPU v5p through
Mosaic (libtpu ahead-of-time, no TPU needed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_harness import (F32_TOL, NAMES, KernelCase, assert_kernel_close, bf16_bounds,
                            check_kv_halves, compiled_for_four_v5p_chips,
                            kernel_call_names, largest_intermediate, max_err)
from lctrain.kernels import pallas, triton

BLOCK = 32
CASE = KernelCase(impl="pallas", b=2, s=96, hq=8, d=16, block=BLOCK)  # 3 x 3 blocks
B, S, HQ, D = CASE.b, CASE.s, CASE.hq, CASE.d
MODULES = {"pallas": pallas, "triton": triton}


@pytest.fixture(params=tuple(MODULES))
def case(request):
    """CASE for each Pallas kernel (triton's tiles: 32 x 32 at this length)."""
    return KernelCase(impl=request.param, b=B, s=S, hq=HQ, d=D, block=BLOCK)


# ------------------------------------------------------------------ tests ----

def test_impl_pallas_calls_our_forward_and_fused_backward_kernels():
    assert kernel_call_names("pallas", CASE) == {"lctrain_flash_forward",
                                                 "lctrain_flash_backward"}


@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_gqa_ratios_causal(case, gqa):
    """hq = 8 query heads over 8 // gqa kv heads (query head i uses kv head i // gqa),
    causal, s = 96 in 32-blocks: skipped, unmasked and masked block pairs. F32_TOL."""
    q, k, v = case.qkv(gqa, hkv=HQ // gqa)
    pos, seg = case.arange(), case.one_segment()
    got, want = case.run(q, k, v, pos, pos, seg, seg, seed=gqa)
    assert_kernel_close(got, want)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_segments(case, causal):
    """Four documents per row (different boundaries per row), positions restarting per
    document, GQA 4; non-causal attention still stays inside each document. F32_TOL."""
    q, k, v = case.qkv(10)
    pos, seg = case.packed(n_docs=4, seed=10)
    got, want = case.run(q, k, v, pos, pos, seg, seg, causal=causal, seed=10)
    assert_kernel_close(got, want)


@pytest.mark.parametrize("kv_chunk", [0, 1, 2], ids=["kv0", "kv1", "diagonal"])
def test_ring_step_offsets(case, kv_chunk):
    """A ring step: q is chunk 2 of a 4-chunk sequence (positions 192..287), k/v are
    chunk `kv_chunk`: earlier chunks fully visible (no mask at all), the diagonal one
    causal. F32_TOL."""
    q, k, v = case.qkv(12 + kv_chunk)
    seg = case.one_segment()
    got, want = case.run(q, k, v, case.arange(offset=2 * S), case.arange(offset=kv_chunk * S),
                         seg, seg, seed=kv_chunk)
    assert_kernel_close(got, want)
    assert np.all(np.isfinite(got["lse"]))


def test_ring_step_future_chunk_is_fully_masked(case):
    """q = chunk 2, k/v = chunk 3: every block pair is skipped. Exactly out == 0,
    lse == -inf, dq == dk == dv == 0 under nonzero cotangents (bound 0)."""
    q, k, v = case.qkv(20)
    seg = case.one_segment()
    got, want = case.run(q, k, v, case.arange(offset=2 * S), case.arange(offset=3 * S), seg, seg)
    assert np.all(np.isneginf(got["lse"]))
    for name in ("out", "dq", "dk", "dv"):
        assert np.all(got[name] == 0), name
    assert_kernel_close(got, want, dict.fromkeys(NAMES, 0.0))


@pytest.mark.parametrize("scenario", ["causal", "later_documents", "earlier_documents"])
def test_skipped_blocks_are_never_read(case, scenario):
    """Block pairs that bounds rule out are skipped, not masked: NaN keys and values in
    a poisoned kv block must not reach the out, lse or dq of query blocks that cannot
    see it (a mask alone would not stop 0 * NaN). Those rows equal the reference on
    clean inputs (F32_TOL).
      causal: in order, one document; q blocks 0, 1 precede kv block 2 (poisoned).
      later / earlier_documents: not causal, one document per block; the poisoned kv
        block 2 (0) holds only later (earlier) segments than q blocks 0, 1 (1, 2)."""
    q, k, v = case.qkv(22)
    causal = scenario == "causal"
    if causal:
        pos, seg = case.arange(), case.one_segment()
    else:
        seg = case.arange() // BLOCK
        pos = case.arange() - seg * BLOCK
    poisoned, unaffected = ((2, slice(0, 2 * BLOCK)) if scenario != "earlier_documents"
                            else (0, slice(BLOCK, 3 * BLOCK)))
    k_nan, v_nan = (x.at[:, poisoned * BLOCK:(poisoned + 1) * BLOCK].set(jnp.nan)
                    for x in (k, v))
    got, _ = case.run(q, k_nan, v_nan, pos, pos, seg, seg, causal=causal, seed=22)
    _, want = case.run(q, k, v, pos, pos, seg, seg, causal=causal, seed=22)
    for name, axis in (("out", 1), ("lse", 2), ("dq", 1)):
        rows = [slice(None)] * 3
        rows[axis] = unaffected
        assert max_err(got[name][tuple(rows)], want[name][tuple(rows)]) <= F32_TOL, name


def test_some_rows_empty(case):
    """Queries whose segment has no keys, and causal queries before every key, get
    out 0 / lse -inf and zero gradients; the other rows are unaffected. Keys start at
    position 31, so query 31 sees exactly one key: the corner of its block pair, which
    must not be skipped. F32_TOL."""
    q, k, v = case.qkv(21)
    q_seg = case.one_segment()
    q_seg[:, 40:50] = 7  # segment 7 has no keys
    kv_pos = case.arange(offset=BLOCK - 1)
    got, want = case.run(q, k, v, case.arange(), kv_pos, q_seg, case.one_segment(), seed=21)
    empty = [*range(BLOCK - 1), *range(40, 50)]
    assert np.all(np.isneginf(got["lse"][:, :, empty]))
    assert np.all(got["out"][:, empty] == 0) and np.all(got["dq"][:, empty] == 0)
    assert np.all(np.isfinite(np.delete(got["lse"], empty, axis=2)))
    assert_kernel_close(got, want)


def test_load_balanced_permutation(case):
    """Tokens (of three packed documents) stored in a shuffled order, positions and
    segments moving with them: the kernel on the shuffled layout equals the reference
    in the original order, shuffled. Masks come from positions, not indices. F32_TOL."""
    q, k, v = case.qkv(30)
    pos, seg = case.packed(n_docs=3, seed=30)
    perm = np.random.default_rng(30).permutation(S)
    cot_out, cot_lse = case.cotangents(30)

    def shuffle(x, axis=1):
        return np.take(np.asarray(x), perm, axis=axis)

    got, _ = case.run(*(jnp.asarray(shuffle(x)) for x in (q, k, v)), shuffle(pos),
                      shuffle(pos), shuffle(seg), shuffle(seg), cotangents=(cot_out, cot_lse))
    inv = np.argsort(perm)
    _, ref = case.run(q, k, v, pos, pos, seg, seg,
                      cotangents=(cot_out[:, inv], cot_lse[:, :, inv]))
    want = {n: shuffle(x, axis=2 if n == "lse" else 1) for n, x in ref.items()}
    assert_kernel_close(got, want)


def test_bf16_inputs(case):
    """bf16 q/k/v (packed, causal) vs the f32 reference on the same rounded inputs.
    Bounds: max abs err <= BF16_REL * max|reference| for out and grads, BF16_LSE_TOL
    absolute for lse. out and grads come back in bf16."""
    q, k, v = case.qkv(40, dtype=jnp.bfloat16)
    pos, seg = case.packed(n_docs=2, seed=40)
    got, want = case.run(q, k, v, pos, pos, seg, seg, seed=40)
    assert_kernel_close(got, want, bf16_bounds(want))


def test_kv_halves_like_a_ring(case):
    """Keys split in two halves of 48 (blocks of 24: sq != skv), two packed documents so
    some queries see nothing in the second half (lse -inf there). (1) Halves merged
    through lse, differentiated with out and lse cotangents; (2) the block backward of
    each half given the final out/lse, summed, vs the full gradient. Both F32_TOL."""
    check_kv_halves(MODULES[case.impl], case, 25, *case.packed(n_docs=2, seed=25))


def test_memory_is_linear_in_sequence_length():
    """Forward + backward at s = 1024 never create an [sq, skv]-sized array, not even
    a mask: the largest intermediate (kernel bodies included) is < s * s. Tracing only."""
    s = 1024
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, s, 2, D), dtype=np.float32))
               for _ in range(3))
    pos, seg = np.arange(s, dtype=np.int32)[None], np.zeros((1, s), np.int32)

    def loss(q, k, v):
        out, lse = pallas.flash_attention(q, k, v, pos, pos, seg, seg, block_q=128,
                                          block_kv=128)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert largest_intermediate(jaxpr) < s * s


def test_tpu_block_sizes():
    """On TPU a block is a multiple of 128 dividing the length, or the whole length;
    interpret mode takes the largest divisor (any size)."""
    assert pallas.block_size(8192, 512, interpret=False) == 512
    assert pallas.block_size(3 * 128, 512, interpret=False) == 384
    assert pallas.block_size(5 * 128, 512, interpret=False) == 128
    assert pallas.block_size(96, 512, interpret=False) == 96
    with pytest.raises(ValueError, match="multiple of 128"):
        pallas.block_size(1000, 512, interpret=False)
    assert pallas.block_size(96, 64, interpret=True) == 48


@pytest.mark.slow
def test_compiles_for_tpu_v5p_through_mosaic():
    """Forward + backward and the ring-style block backward, compiled for 4 TPU v5p chips
    inside a shard_map with its default check_vma=True (kernel_harness): the HLO holds
    the Mosaic kernels (forward, the fused backward, then the block backward's)."""
    hlo = compiled_for_four_v5p_chips(pallas, check_vma=True)
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3
    for kernel in ("lctrain_flash_forward", "lctrain_flash_backward"):
        assert kernel in hlo
