"""The two layouts of q, k, v and out a kernel call may take.

TOKENS_MAJOR [b, s, h, d] is the model's (projections, RoPE, the strategies' sharding).
HEADS_MAJOR [b, h, s, d] is what the Pallas kernels tile ([block, d] per head). A kernel
called in the other layout swaps axes 1 and 2 inside its custom VJP; a caller that calls
a kernel many times per layer (ring attention, once per step) asks for the kernel's own
layout (`kernels.native_layout`) and converts once, so no step pays a relayout copy.
"""

import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

TOKENS_MAJOR = "bshd"
HEADS_MAJOR = "bhsd"
LAYOUTS = (TOKENS_MAJOR, HEADS_MAJOR)


def convert(x, source: str, target: str):
    """x from layout `source` to layout `target` (either way it is one axis swap)."""
    return x if source == target else jnp.swapaxes(x, 1, 2)


def relayout(x, source: str, target: str):
    """x from `source` to `target`; a tensor made head-major is pinned row-major (below):
    the one relayout a layer pays, where it converts."""
    if source == target:
        return x
    x = convert(x, source, target)
    return pinned_row_major(x) if target == HEADS_MAJOR else x


def row_dot(out, dout, layout: str):
    """delta, f32 [b, h, s]: per query row, sum over d of out * dout, the softmax-Jacobian
    term of attention's backward (sum_j p_ij dp_ij). A caller that runs the backward of
    many kv blocks against the same rows (ring attention) computes it once and need not
    keep `out` for them."""
    spec = "bshd,bshd->bhs" if layout == TOKENS_MAJOR else "bhsd,bhsd->bhs"
    return jnp.einsum(spec, out.astype(jnp.float32), dout.astype(jnp.float32))


def axes(layout: str) -> tuple[int, int]:
    """(sequence axis, heads axis) of a tensor in `layout`."""
    return (1, 2) if layout == TOKENS_MAJOR else (2, 1)


def tokens_major_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """[b, s, h, d] sizes of an array of `shape` in `layout`."""
    b, first, second, d = shape
    return (b, first, second, d) if layout == TOKENS_MAJOR else (b, second, first, d)


def seq_len(x, layout: str) -> int:
    return tokens_major_shape(x.shape, layout)[1]


def pinned_row_major(x):
    """x, laid out row-major in memory, as a Mosaic kernel reads its operands. XLA picks
    the layout of every other array itself, and across a loop or a branch it may pick
    another one for a kernel's operand (e.g. [b, h, d, s] for q) and relayout it inside
    on every call; pinned once where a layer converts its tensors, they stay put."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))

