"""Splash attention (kernels/splash.py) against the dense f32 reference.

On CPU splash's kernels run in Pallas interpret mode, with the block map we build from
positions. Positions here are what every strategy hands the kernel: sequence indices,
contiguous in blocks of 128 (splash's smallest tile), documents told apart by segment
ids only. The last test (marked slow) compiles forward + backward for a TPU v5p.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_harness import (KernelCase, assert_kernel_close, bf16_bounds, check_kv_halves,
                            compiled_for_four_v5p_chips, kernel_call_names)
from lctrain.kernels import attention, resolve_impl, splash
from lctrain.parallel import STRATEGIES
from lctrain.parallel.strategy import load_balanced_order
from lctrain.recipes import RecipeError, load_recipe

CASE = KernelCase(impl="splash", b=2, s=512, hq=8, d=16, block=128)  # 4 x 4 blocks


def _packed_indices(n_docs, seed):
    """(sequence indices, segment ids) of n_docs packed documents per row."""
    _, seg = CASE.packed(n_docs, seed)
    return CASE.arange(), seg


def test_impl_splash_calls_the_splash_kernels():
    names = kernel_call_names("splash", CASE)
    assert names and all(name.startswith("splash_mha") for name in names), names


@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
def test_gqa_ratios_causal(gqa):
    """hq = 8 query heads over 8 // gqa kv heads, causal: skipped, full and diagonal
    block pairs. F32_TOL."""
    q, k, v = CASE.qkv(gqa, hkv=CASE.hq // gqa)
    pos, seg = CASE.arange(), CASE.one_segment()
    got, want = CASE.run(q, k, v, pos, pos, seg, seg, seed=gqa)
    assert_kernel_close(got, want)


def test_odd_number_of_blocks():
    """384 tokens: three 128-token blocks, packed documents. F32_TOL."""
    case = dataclasses.replace(CASE, s=384)
    q, k, v = case.qkv(70)
    _, seg = case.packed(n_docs=2, seed=70)
    assert_kernel_close(*case.run(q, k, v, case.arange(), case.arange(), seg, seg, seed=70))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_packed_segments(causal):
    """Four documents per row, boundaries inside blocks and different per row: segment
    ids keep them apart, causal or not. F32_TOL."""
    q, k, v = CASE.qkv(10)
    pos, seg = _packed_indices(n_docs=4, seed=10)
    got, want = CASE.run(q, k, v, pos, pos, seg, seg, causal=causal, seed=10)
    assert_kernel_close(got, want)


@pytest.mark.parametrize("kv_chunk", [0, 1, 2, 3], ids=["kv0", "kv1", "diagonal", "future"])
def test_ring_step_offsets(kv_chunk):
    """A ring step: q is chunk 2 of a 4-chunk sequence, k/v chunk `kv_chunk`: earlier
    chunks fully visible, the diagonal causal, a later one entirely masked (out 0, lse
    -inf, zero gradients, exactly). F32_TOL."""
    q, k, v = CASE.qkv(12 + kv_chunk)
    seg = CASE.one_segment()
    got, want = CASE.run(q, k, v, CASE.arange(offset=2 * CASE.s),
                         CASE.arange(offset=kv_chunk * CASE.s), seg, seg, seed=kv_chunk)
    assert_kernel_close(got, want)
    if kv_chunk == 3:
        assert np.all(np.isneginf(got["lse"]))
        assert all(np.all(got[name] == 0) for name in ("out", "dq", "dk", "dv"))


def test_load_balanced_layout():
    """Three packed documents stored in the load-balanced order of 2-way context
    parallelism (chunks 0, 3, 1, 2 of 128 tokens), indices and segments moving with the
    tokens: equals the reference on the same layout. F32_TOL."""
    q, k, v = CASE.qkv(30)
    order = load_balanced_order(CASE.s, 2)
    pos, seg = (x[:, order] for x in _packed_indices(n_docs=3, seed=30))
    got, want = CASE.run(q, k, v, pos, pos, seg, seg, seed=30)
    assert_kernel_close(got, want)


def test_some_rows_empty():
    """Queries whose segment has no keys, and queries before every key (keys start one
    block later), get out 0 / lse -inf and zero gradients; other rows are unaffected.
    F32_TOL."""
    q, k, v = CASE.qkv(21)
    q_seg = CASE.one_segment()
    q_seg[:, 200:210] = 7  # segment 7 has no keys
    got, want = CASE.run(q, k, v, CASE.arange(), CASE.arange(offset=CASE.block), q_seg,
                         CASE.one_segment(), seed=21)
    empty = [*range(CASE.block), *range(200, 210)]
    assert np.all(np.isneginf(got["lse"][:, :, empty]))
    assert np.all(got["out"][:, empty] == 0) and np.all(got["dq"][:, empty] == 0)
    assert_kernel_close(got, want)


@pytest.mark.parametrize("block_q, block_kv", [(128, 256), (256, 128)])
def test_unequal_blocks(block_q, block_kv):
    """q and kv blocks of different sizes: partial pairs overlap by one or two of the
    smaller block, two diagonal patterns. Packed documents, and a ring step whose keys
    are the previous chunk's second half plus the query chunk. F32_TOL."""
    case = dataclasses.replace(CASE, block=block_q, block_kv=block_kv)
    q, k, v = case.qkv(60)
    pos, seg = _packed_indices(n_docs=3, seed=60)
    assert_kernel_close(*case.run(q, k, v, pos, pos, seg, seg, seed=60))
    one = case.one_segment()
    assert_kernel_close(*case.run(q, k, v, case.arange(offset=case.s),
                                  case.arange(offset=case.s // 2), one, one, seed=61))


def test_kv_halves_like_a_ring():
    """Keys in two halves of 256, two packed documents: (1) the halves merged through
    lse and differentiated with out and lse cotangents, (2) each half's block backward
    given the final out/lse, summed: both equal the full attention. F32_TOL."""
    check_kv_halves(splash, CASE, 25, *_packed_indices(n_docs=2, seed=25))


def test_bf16_inputs():
    """bf16 q/k/v (packed, causal) vs the f32 reference on the same rounded inputs
    (the query scale 1/sqrt(16) is exact in bf16). Bounds: BF16_REL of the reference's
    largest value for out and grads, BF16_LSE_TOL for lse."""
    q, k, v = CASE.qkv(40, dtype=jnp.bfloat16)
    pos, seg = _packed_indices(n_docs=2, seed=40)
    got, want = CASE.run(q, k, v, pos, pos, seg, seg, seed=40)
    assert_kernel_close(got, want, bf16_bounds(want))


def test_positions_off_the_block_grid_give_nan_not_a_wrong_answer():
    """Keys shifted by one token: block pairs are no longer the same tokens on the
    diagonal, which the stored pattern assumes. The kernel says so with NaN."""
    q, k, v = CASE.qkv(50)
    seg = CASE.one_segment()
    got, _ = CASE.run(q, k, v, CASE.arange(), CASE.arange(offset=1), seg, seg, seed=50)
    assert np.all(np.isnan(got["out"]))


def test_auto_picks_splash_on_tpu_when_the_chunks_allow():
    assert resolve_impl("auto", "tpu", chunk_tokens=1024) == "splash"
    assert resolve_impl("auto", "tpu", chunk_tokens=64) == "pallas"
    assert resolve_impl("auto", "tpu") == "pallas"  # layout unknown
    assert resolve_impl("auto", "cpu", chunk_tokens=1024) == "xla"


@pytest.mark.parametrize("sq, skv, kernel", [(2**18, 2**18, "splash_mha_fwd"),
                                             (2**18, 2**20, "lctrain_flash_forward")])
def test_auto_falls_back_to_pallas_where_the_block_map_cannot_fit(sq, skv, kernel):
    """Traced for a TPU (nothing runs): 256K x 256K takes splash, 256K queries x 1M keys
    (all_gather at 1M on 4 chips) our Pallas kernel."""
    def call(q, k, v, qp, kp, seg_q, seg_kv):
        return attention(q, k, v, q_positions=qp, kv_positions=kp, q_segment_ids=seg_q,
                         kv_segment_ids=seg_kv, impl="auto", platform="tpu",
                         run_tokens=2**17)

    def shaped(s, heads, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct((1, s, heads, 128), dtype)

    ids = [jax.ShapeDtypeStruct((1, s), jnp.int32) for s in (sq, skv)]
    jaxpr = str(jax.make_jaxpr(call)(shaped(sq, 8), shaped(skv, 2), shaped(skv, 2), *ids, *ids))
    assert kernel in jaxpr


def test_recipe_splash_cannot_tile_is_refused():
    """Chunks of the stored sequence (seq_len / (2 * context) when load-balanced) that are
    no multiple of 128, or a block map too big for splash's scalar memory: RecipeError
    naming the key, at load (strategy check), before anything compiles."""
    def check(seq_len, context, strategy="ring"):
        recipe = load_recipe("tiny", ["attention.impl=splash", f"data.seq_len={seq_len}",
                                    f"parallel.strategy={strategy}", f"mesh.context={context}"])
        sizes = {"data": 8 // context, "fsdp": 1, "context": context, "tensor": 1}
        STRATEGIES[strategy].check(recipe, sizes)

    check(1024, 4)  # chunks of 128
    with pytest.raises(RecipeError, match=r"'attention.impl' = 'splash'.*chunks of 64 tokens"):
        check(1024, 8)
    with pytest.raises(RecipeError, match="chunks of 125 tokens"):
        check(1000, 4)
    check(2**20, 4)  # 1M tokens: ring steps of 256K x 256K keys fit (1024-token kv blocks)
    with pytest.raises(RecipeError, match="262144 queries x 1048576 keys.*impl=pallas"):
        check(2**20, 4, "all_gather")


def test_block_sizes():
    """Tiles are the largest multiples of 128 dividing the lengths (and the contiguous
    runs), capped by the request; kv blocks grow (computed in the requested slices) until
    the block map has at most 2**17 entries, up to 1024 tokens: 256K x 256K fits, 256K
    queries x 1M keys does not."""
    assert splash.block_sizes(8192, 4096, 512, 512) == (512, 512, 512)
    assert splash.block_sizes(3 * 128, 6 * 128, 512, 512) == (384, 384, 384)
    assert splash.block_sizes(5 * 128, 5 * 128, 512, 512) == (128, 128, 128)
    assert splash.block_sizes(2**18, 2**18, 512, 512) == (512, 1024, 512)
    assert splash.block_sizes(2**18, 2**18, 512, 512, run_tokens=2**17) == (512, 1024, 512)
    assert splash.block_sizes(1024, 2048, 512, 512, run_tokens=256) == (256, 256, 256)
    assert not splash.supports(2**18, 2**20, 512, 512, None)
    with pytest.raises(ValueError, match="multiples of 128"):
        splash.block_sizes(96, 96, 512, 512)


@pytest.mark.slow
def test_compiles_for_tpu_v5p_through_mosaic():
    """Forward + backward and the ring-style block backward, compiled for 4 TPU v5p chips
    (kernel_harness.compiled_for_four_v5p_chips): the HLO holds splash's Mosaic kernels
    (forward, dq, dk/dv, then dq, dk/dv of the block backward)."""
    hlo = compiled_for_four_v5p_chips(splash, check_vma=False)
    kernels = [line for line in hlo.splitlines()
               if 'custom_call_target="tpu_custom_call"' in line]
    assert len(kernels) == 5
    for phase, count in (("fwd", 1), ("dq", 2), ("dkv", 2)):
        assert sum(f"splash_mha_{phase}" in line for line in kernels) == count, phase
