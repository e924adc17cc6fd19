"""Attention kernels: the single entry point every context-parallel strategy calls.

`attention` validates shapes and dispatches to an implementation by name. Each
implementation is a `Kernel`: a differentiable forward with the signature

    forward(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
            *, causal, window, block_q, block_kv, platform, layout) -> (out, lse)

and the backward of one kv block given the rows' final out and lse (for ring attention),
so adding a backend is one entry in `_IMPLS`. Each computes in its own layout of q, k,
v (kernels/layout.py) and takes either; `native_layout` tells a caller that calls a
kernel many times which one to keep its tensors in. impl="auto"
(a recipe option) picks the best registered backend for the platform.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from . import pallas, splash, triton, xla
from .layout import HEADS_MAJOR, LAYOUTS, TOKENS_MAJOR, row_dot, tokens_major_shape
from .masks import attention_mask, check_window


class Kernel(NamedTuple):
    """A backend: the differentiable attention, and the backward of one kv block given the
    final out/lse of its rows (what ring attention's custom backward needs).
    `layout`: the one it computes in (the other costs a relayout of q, k, v, out per call).
    `takes_runs`: it classifies whole blocks and takes `run_tokens` (the length of the
    contiguous runs of positions) to keep every block inside one run. `sums_grads`: its
    block backward adds dq, dk and dv into a caller's f32 sums itself (`dq_sum`,
    `dkv_sum`)."""
    forward: Callable
    block_backward: Callable
    layout: str
    takes_runs: bool = False
    sums_grads: bool = False


_IMPLS = {
    "xla": Kernel(xla.flash_attention, xla.flash_attention_backward, TOKENS_MAJOR),
    "pallas": Kernel(pallas.flash_attention, pallas.flash_attention_backward, HEADS_MAJOR,
                     sums_grads=True),
    "splash": Kernel(splash.flash_attention, splash.flash_attention_backward, HEADS_MAJOR,
                     takes_runs=True),
    "triton": Kernel(triton.flash_attention, triton.flash_attention_backward, TOKENS_MAJOR),
}

IMPLS = tuple(_IMPLS)

# impl="auto", as the recipe schema documents it: splash on TPU where the layout allows,
# else our Pallas kernel; xla elsewhere. The pallas and splash kernels are TPU kernels: on
# GPU an explicit pallas or splash runs xla (impl_for_call). triton, the GPU kernel, is
# chosen by name until it has been timed against cuDNN on a GPU (docs/kernels.md).
_AUTO_PREFERENCE = {"tpu": ("splash", "pallas")}
GPU_ONLY = "attention.impl=triton is the NVIDIA GPU kernel; on TPU use auto, pallas or splash"


def resolve_impl(impl: str, platform: str | None = None, chunk_tokens: int | None = None) -> str:
    """The registered backend name `impl` stands for on `platform` (default: jax's
    backend); ValueError if there is none. `chunk_tokens`, the length of the contiguous
    chunks the stored sequence is made of, lets "auto" pick splash (unknown: it doesn't)."""
    if impl == "auto":
        preferred = _AUTO_PREFERENCE.get(platform or jax.default_backend(), ())
        return next((name for name in preferred
                     if name != "splash" or splash.fits_chunks(chunk_tokens)), "xla")
    if impl not in _IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; allowed: "
                         f"{sorted(_IMPLS) + ['auto']}")
    return impl


def attention(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              causal=True, impl="xla", block_q=512, block_kv=512, return_lse=False,
              platform=None, run_tokens=None, layout=TOKENS_MAJOR, window=None):
    """Masked multi-head (GQA) attention with softmax scale 1/sqrt(d).

    Args:
      q: [b, sq, hq, d]; k, v: [b, skv, hkv, d], hq % hkv == 0 (query head i
        uses kv head i // (hq // hkv)). Any float dtype; accumulation is f32.
        With layout=HEADS_MAJOR ("bhsd") they are [b, h, s, d] instead, and so is out.
      q_positions, kv_positions: int [b, sq] / [b, skv] TRUE token positions
        (the arrays may be reordered or be chunks of a longer sequence).
      q_segment_ids, kv_segment_ids: int [b, sq] / [b, skv] document ids.
      causal: query i may attend key j iff segments match and, if causal,
        q_positions[i] >= kv_positions[j].
      window: sliding window (Mistral / Gemma): also q_positions[i] - kv_positions[j]
        < window, per document (kernels/masks.py); None: global attention. Splash has
        none: "auto" then runs the Pallas kernel, impl="splash" raises (impl_for_call).
      impl: backend name, one of `IMPLS`, or "auto" (see `resolve_impl`).
      block_q, block_kv: tile sizes (rounded down to divisors of sq / skv).
      return_lse: also return the log-sum-exp of the scaled scores.
      platform: what the program is compiled for ("cpu", "gpu", "tpu"); default jax's
        backend. An ahead-of-time compile for a TPU topology on a CPU host passes "tpu".
      run_tokens: q and kv are made of contiguous runs of this many sequence positions
        (the chunks of a context-parallel layout); None: one run each. Only kernels
        that classify whole blocks (splash) use it.

    Returns:
      out [b, sq, hq, d] (in `layout`) in q.dtype, or (out, lse [b, hq, sq] f32) with
      return_lse. Rows with no allowed key get out = 0 and lse = -inf.
      Differentiable w.r.t. q, k, v and through lse.
    """
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, layout)
    check_window(window)
    kernel = _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens, layout, window)
    out, lse = kernel.forward(q, k, v, q_positions, kv_positions, q_segment_ids,
                              kv_segment_ids, causal=causal, window=window, block_q=block_q,
                              block_kv=block_kv, platform=platform, layout=layout,
                              **_runs(kernel, run_tokens))
    return (out, lse) if return_lse else out


def impl_for_call(impl: str, platform: str | None, sq: int, skv: int, block_q: int,
                  block_kv: int, run_tokens: int | None, window: int | None = None) -> str:
    """The backend name one call of sq queries x skv keys runs: "auto" takes splash only
    where its tiles fit these lengths and there is no `window`, else our Pallas kernel;
    on GPU always xla. ValueError for impl="splash" with a window (splash has none)."""
    name = resolve_impl(impl, platform, run_tokens)
    on = platform or jax.default_backend()
    if name == "triton":
        if on == "tpu":
            raise ValueError(GPU_ONLY)
        return name  # on CPU it runs interpreted (the tests)
    if on == "gpu":
        return "xla"
    if window is not None and name == "splash":
        if impl == "auto":
            return "pallas"
        raise ValueError(f"{splash.NO_WINDOW}; got window={window}")
    if impl == "auto" and name == "splash" and not splash.supports(sq, skv, block_q, block_kv,
                                                                   run_tokens):
        return "pallas"
    return name


def native_layout(sq: int, skv: int, *, impl: str = "xla", block_q: int = 512,
                  block_kv: int = 512, platform: str | None = None,
                  run_tokens: int | None = None, window: int | None = None) -> str:
    """The layout the kernel that runs calls of sq queries x skv keys computes in, for
    callers that call it many times: kept in it, their tensors cross no relayout per call."""
    return _IMPLS[impl_for_call(impl, platform, sq, skv, block_q, block_kv, run_tokens,
                                window)].layout


def _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens, layout, window):
    sq, skv = (tokens_major_shape(x.shape, layout)[1] for x in (q, k))
    return _IMPLS[impl_for_call(impl, platform, sq, skv, block_q, block_kv, run_tokens,
                                window)]


def _runs(kernel, run_tokens):
    return {"run_tokens": run_tokens} if kernel.takes_runs else {}


def _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                  layout):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: {LAYOUTS}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-d ({layout}); got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    b, sq, hq, d = tokens_major_shape(q.shape, layout)
    _, skv, hkv, dk = tokens_major_shape(k.shape, layout)
    if k.shape[0] != b or dk != d:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head dim")
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    for name, x, want in (("q_positions", q_positions, (b, sq)),
                          ("kv_positions", kv_positions, (b, skv)),
                          ("q_segment_ids", q_segment_ids, (b, sq)),
                          ("kv_segment_ids", kv_segment_ids, (b, skv))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")


def attention_block_backward(q, k, v, delta, lse, dout, *, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, causal=True, impl="xla",
                             block_q=512, block_kv=512, platform=None, run_tokens=None,
                             layout=TOKENS_MAJOR, dq_sum=None, dkv_sum=None, window=None):
    """(dq, dk, dv) of attention between q and one kv block, where `lse` [b, hq, sq] is
    the rows' result over ALL kv blocks (merged by the caller) and `delta` [b, hq, sq]
    f32 is `row_dot(out, dout, layout)` of their final out: computed once by a caller
    that runs many kv blocks, which then need not keep out for them.
    q, k, v, dout and the results are in `layout`. With `dq_sum` (f32, q's shape)
    dq is dq_sum plus this block's dq, in f32; with `dkv_sum` (a pair of f32 arrays of
    k's shape) dk and dv likewise: what a caller summing gradients over kv blocks (ring
    attention) keeps, without second f32 buffers where the kernel adds into them itself."""
    check_window(window)
    kernel = _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens, layout, window)
    summed = {"dq_sum": dq_sum, "dkv_sum": dkv_sum} if kernel.sums_grads else {}
    dq, dk, dv = kernel.block_backward(q, k, v, delta, lse, dout, q_positions, kv_positions,
                                       q_segment_ids, kv_segment_ids, causal=causal,
                                       window=window,
                                       block_q=block_q, block_kv=block_kv, platform=platform,
                                       layout=layout, **summed, **_runs(kernel, run_tokens))
    if not summed:
        dq = dq if dq_sum is None else dq_sum + dq.astype(jnp.float32)
        if dkv_sum is not None:
            dk, dv = (total + x.astype(jnp.float32) for total, x in zip(dkv_sum, (dk, dv)))
    return dq, dk, dv


__all__ = ["HEADS_MAJOR", "IMPLS", "TOKENS_MAJOR", "attention", "attention_block_backward",
           "attention_mask", "impl_for_call", "native_layout", "resolve_impl", "row_dot"]
