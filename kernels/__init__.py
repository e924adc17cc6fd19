"""Attention kernels: the single entry point every context-parallel strategy calls.

`attention` validates shapes and dispatches to an implementation by name. Each
implementation is a `Kernel`: a differentiable forward with the signature

    forward(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
            *, causal, block_q, block_kv) -> (out, lse)

and the backward of one kv block given the rows' final out and lse (for ring attention),
so adding a backend is one entry in `_IMPLS`. impl="auto"
(a recipe option) picks the best registered backend for the platform.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from . import pallas, splash, xla
from .masks import attention_mask

class Kernel(NamedTuple):
    """A backend: the differentiable attention, and the backward of one kv block given the
    final out/lse of its rows (what ring attention's custom backward needs).
    `takes_runs`: it classifies whole blocks and takes `run_tokens` (the length of the
    contiguous runs of positions) to keep every block inside one run."""
    forward: Callable
    block_backward: Callable
    takes_runs: bool = False


_IMPLS = {
    "xla": Kernel(xla.flash_attention, xla.flash_attention_backward),
    "pallas": Kernel(pallas.flash_attention, pallas.flash_attention_backward),
    "splash": Kernel(splash.flash_attention, splash.flash_attention_backward, takes_runs=True),
}

IMPLS = tuple(_IMPLS)

# impl="auto", as the recipe schema documents it: splash on TPU where the layout allows,
# else our Pallas kernel; xla elsewhere (on GPU the Pallas kernel itself falls back to xla).
_AUTO_PREFERENCE = {"tpu": ("splash", "pallas")}


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
              platform=None, run_tokens=None):
    """Masked multi-head (GQA) attention with softmax scale 1/sqrt(d).

    Args:
      q: [b, sq, hq, d]; k, v: [b, skv, hkv, d], hq % hkv == 0 (query head i
        uses kv head i // (hq // hkv)). Any float dtype; accumulation is f32.
      q_positions, kv_positions: int [b, sq] / [b, skv] TRUE token positions
        (the arrays may be reordered or be chunks of a longer sequence).
      q_segment_ids, kv_segment_ids: int [b, sq] / [b, skv] document ids.
      causal: query i may attend key j iff segments match and, if causal,
        q_positions[i] >= kv_positions[j].
      impl: backend name, one of `IMPLS`, or "auto" (see `resolve_impl`).
      block_q, block_kv: tile sizes (rounded down to divisors of sq / skv).
      return_lse: also return the log-sum-exp of the scaled scores.
      platform: what the program is compiled for ("cpu", "gpu", "tpu"); default jax's
        backend. An ahead-of-time compile for a TPU topology on a CPU host passes "tpu".
      run_tokens: q and kv are made of contiguous runs of this many sequence positions
        (the chunks of a context-parallel layout); None: one run each. Only kernels
        that classify whole blocks (splash) use it.

    Returns:
      out [b, sq, hq, d] in q.dtype, or (out, lse [b, hq, sq] f32) with
      return_lse. Rows with no allowed key get out = 0 and lse = -inf.
      Differentiable w.r.t. q, k, v and through lse.
    """
    kernel = _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens)
    _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    out, lse = kernel.forward(q, k, v, q_positions, kv_positions, q_segment_ids,
                              kv_segment_ids, causal=causal, block_q=block_q,
                              block_kv=block_kv, platform=platform,
                              **_runs(kernel, run_tokens))
    return (out, lse) if return_lse else out


def impl_for_call(impl: str, platform: str | None, sq: int, skv: int, block_q: int,
                  block_kv: int, run_tokens: int | None) -> str:
    """The backend name one call of sq queries x skv keys runs: "auto" takes splash only
    where its tiles fit these lengths, else our Pallas kernel."""
    name = resolve_impl(impl, platform, run_tokens)
    if impl == "auto" and name == "splash" and not splash.supports(sq, skv, block_q, block_kv,
                                                                   run_tokens):
        return "pallas"
    return name


def _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens):
    return _IMPLS[impl_for_call(impl, platform, q.shape[1], k.shape[1], block_q, block_kv,
                                run_tokens)]


def _runs(kernel, run_tokens):
    return {"run_tokens": run_tokens} if kernel.takes_runs else {}


def _check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [b, s, h, d]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    b, sq, hq, d = q.shape
    _, skv, hkv, dk = k.shape
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


def attention_block_backward(q, k, v, out, lse, dout, *, q_positions, kv_positions,
                             q_segment_ids, kv_segment_ids, causal=True, impl="xla",
                             block_q=512, block_kv=512, platform=None, run_tokens=None):
    """(dq, dk, dv) of attention between q and one kv block, where `out` [b, sq, hq, d] and
    `lse` [b, hq, sq] are the rows' results over ALL kv blocks (merged by the caller)."""
    kernel = _kernel_for(impl, platform, q, k, block_q, block_kv, run_tokens)
    return kernel.block_backward(q, k, v, out, lse, dout, q_positions, kv_positions,
                                 q_segment_ids, kv_segment_ids, causal=causal,
                                 block_q=block_q, block_kv=block_kv, platform=platform,
                                 **_runs(kernel, run_tokens))


__all__ = ["IMPLS", "attention", "attention_block_backward", "attention_mask", "impl_for_call",
           "resolve_impl"]
