"""The Pallas kernels' structure, read without running them (tests/test_pallas_structure.py
asserts on it; benchmarks/attention.py prints it where no accelerator can time them).

Copies. The kernels' own BlockSpec index maps are called as the TPU pipeline calls them
(grid indices, then the scalar-prefetch arrays) over the whole grid in grid order; an
operand is copied from HBM whenever its block index differs from the previous step's
(the Pallas TPU pipeline's rule; the first step always copies). A step is COMPUTED
where the kernel's own test (pallas_schedule.step_visibility) says some pair may be
allowed. The ideal is one copy per computed step, less the steps that reuse the
previous computed step's block (a row ending on the block the next row starts with).

Matmuls. The dot_general equations of one computed block pair in each kernel's jaxpr.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import pallas
from .jaxpr_walk import equations
from .pallas_schedule import prefetch_arrays, step_visibility


class CopyFigures(NamedTuple):
    """One operand over one grid: HBM -> VMEM copies, computed steps, the computed steps
    that reuse the block already in VMEM, and all grid steps."""
    copies: int
    computed: int
    reuses: int
    steps: int


class Schedule(NamedTuple):
    """A kernel call's problem and its scalar-prefetch arrays."""
    problem: pallas._Problem
    prefetch: pallas.Prefetch
    causal: bool
    window: int | None = None


def schedule(q_pos, kv_pos, q_seg, kv_seg, causal, heads=4, kv_heads=2, block=32,
             window=None):
    """The Schedule of one call on these [1, s] ids (sliding `window`: kernels/masks.py)."""
    problem = pallas._Problem(1, heads, kv_heads, q_pos.shape[1], kv_pos.shape[1], 16,
                              block, block)
    prefetch = prefetch_arrays(*(jnp.asarray(x) for x in (q_pos, kv_pos, q_seg, kv_seg)),
                               block, block, causal, window)
    return Schedule(problem, prefetch, causal, window)


def walk(sched: Schedule, grid_kind: str):
    """(grid indices of every step in grid order, the Step of each, computed [steps],
    the grid's BlockSpecs) of the query-major (forward) or key-major (backward) grid."""
    grid, locator, specs = getattr(sched.problem, grid_kind)()
    ids = tuple(jnp.asarray(x) for x in np.indices(grid).reshape(len(grid), -1))
    step, some, _ = step_visibility(sched.prefetch, locator, sched.causal, sched.window, *ids)
    return ids, step, np.asarray(some), specs


def copy_figures(spec, ids, prefetch, computed) -> CopyFigures:
    """The copies of the operand `spec` places, over the steps `ids`."""
    blocks = _block_indices(spec, ids, prefetch)
    n_computed = int(computed.sum())
    return CopyFigures(1 + _changes(blocks), n_computed,
                       n_computed - 1 - _changes(blocks[computed]), len(blocks))


def kv_copy_figures(sched: Schedule) -> CopyFigures:
    """The forward's K (and V) block copies."""
    ids, _, computed, specs = walk(sched, "query_major")
    return copy_figures(specs.kv, ids, sched.prefetch, computed)


def _block_indices(spec, ids, prefetch):
    """[steps, rank]: the operand's block index at every step, from its index map."""
    n = ids[0].shape[0]
    return np.stack([np.broadcast_to(np.asarray(x), (n,))
                     for x in spec.index_map(*ids, *prefetch)], axis=-1)


def _changes(blocks):
    return int(np.any(blocks[1:] != blocks[:-1], axis=-1).sum())


# ---------------------------------------------------------------- matmuls ----

def matmuls_per_block_pair() -> dict[str, int]:
    """{kernel name: matmuls of one computed block pair}, from the traced VJP of a tiny
    causal call."""
    s = 64
    x = jnp.ones((1, s, 2, 16))
    pos, seg = np.arange(s, dtype=np.int32)[None], np.zeros((1, s), np.int32)

    def loss(q, k, v):
        out, lse = pallas.flash_attention(q, k, v, pos, pos, seg, seg, block_q=32,
                                          block_kv=32, platform="cpu")
        return jnp.sum(out) + jnp.sum(lse)

    bodies = _kernel_bodies(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr)
    return {name: _matmuls_per_pair(body) for name, body in bodies.items()}


def _matmuls(jaxpr):
    """dot_general equations in a jaxpr, sub-jaxprs included."""
    return sum(eqn.primitive.name == "dot_general" for eqn, _ in equations(jaxpr))


def _kernel_bodies(jaxpr):
    """{pallas_call name: kernel jaxpr} anywhere in a jaxpr."""
    return {eqn.params["name"]: eqn.params["jaxpr"] for eqn, _ in equations(jaxpr)
            if eqn.primitive.name == "pallas_call"}


def _matmuls_per_pair(kernel):
    """Matmuls of one computed block pair: each kernel computes a pair in one of two
    branches (masked, unmasked), which must hold the same matmuls."""
    counts = [_matmuls(branch.jaxpr) for eqn in kernel.eqns if eqn.primitive.name == "cond"
              for branch in eqn.params["branches"]]
    computing = [c for c in counts if c]
    if len(computing) != 2 or computing[0] != computing[1]:
        raise AssertionError(f"expected two computing branches alike, got {counts}")
    return computing[0]
