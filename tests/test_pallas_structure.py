"""The Pallas kernels' structure (kernels/pallas.py), checked without running them: which
blocks the TPU pipeline copies into VMEM, and how many matmuls a block pair costs.

Copies. The tests call the kernels' own BlockSpec index maps (as the pipeline does: grid
indices, then the scalar-prefetch arrays) over the whole grid in grid order, and count a
copy of an operand whenever its block index differs from the previous step's (the Pallas
TPU pipeline's rule; the first step always copies). A step is COMPUTED where the
kernel's own test (pallas_schedule.step_visibility) says some pair may be allowed. The
ideal is one copy per computed step, less the steps that reuse the previous computed
step's block (a row ending on the block the next row starts with): the tests assert the
count equals exactly that, and that every visible block pair is computed once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lctrain.kernels import pallas
from lctrain.kernels.pallas_schedule import pair_visibility, prefetch_arrays, step_visibility
from lctrain.parallel.strategy import load_balanced_order

BLOCK = 32
HQ, HKV = 4, 2  # GQA: two query heads share each kv head


def _packed_segments(s, n_docs, seed, restart_positions):
    """(positions, segment ids) [1, s] of n_docs documents in sequence order; positions
    restart per document, or are the sequence index (as the context strategies pass)."""
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(np.arange(1, s), n_docs - 1, replace=False))
    seg = np.searchsorted(starts, np.arange(s), side="right")
    pos = np.arange(s) - np.concatenate([[0], starts])[seg] if restart_positions else np.arange(s)
    return pos[None].astype(np.int32), seg[None].astype(np.int32)


def _load_balanced(context, s, rank, packed):
    """Sequence index and segment id of every stored token of `rank` (its chunks rank and
    2 * context - 1 - rank, of a sequence of s tokens), or of all ranks (rank None)."""
    order = load_balanced_order(s, context)
    _, seg = _packed_segments(s, 5, 7, False) if packed else (None, np.zeros((1, s), np.int32))
    local = slice(None) if rank is None else slice(rank * s // context, (rank + 1) * s // context)
    return order[None, local].astype(np.int32), seg[:, order][:, local]


def _layout(case):
    """(q positions, kv positions, q segment ids, kv segment ids, causal) of a case."""
    s = 512
    one = np.zeros((1, s), np.int32)
    if case == "causal":
        pos = np.arange(s, dtype=np.int32)[None]
        return pos, pos, one, one, True
    if case == "full":
        pos = np.arange(s, dtype=np.int32)[None]
        return pos, pos, one, one, False
    if case == "packed":
        pos, seg = _packed_segments(s, 4, 3, restart_positions=True)
        return pos, pos, seg, seg, True
    if case == "ring_earlier_chunk":  # q chunk 2 of 4, kv chunk 1: all visible
        return np.arange(2 * s, 3 * s)[None], np.arange(s, 2 * s)[None], one, one, True
    if case == "ring_diagonal":  # the same chunk, offset: causal
        pos = np.arange(2 * s, 3 * s, dtype=np.int32)[None]
        return pos, pos, one, one, True
    if case == "load_balanced_local":  # rank 1 of 2: chunks 1 and 2 of 4
        pos, seg = _load_balanced(2, 2 * s, 1, packed=True)
        return pos, pos, seg, seg, True
    if case == "load_balanced_ring_step":  # rank 1's queries, rank 0's keys (chunks 0, 3)
        q_pos, q_seg = _load_balanced(2, 2 * s, 1, packed=False)
        kv_pos, kv_seg = _load_balanced(2, 2 * s, 0, packed=False)
        return q_pos, kv_pos, q_seg, kv_seg, True
    if case == "load_balanced_gathered":  # all_gather: rank 0's queries, all stored keys
        q_pos, q_seg = _load_balanced(4, 4 * s, 0, packed=True)
        kv_pos, kv_seg = _load_balanced(4, 4 * s, None, packed=True)
        return q_pos, kv_pos, q_seg, kv_seg, True
    raise ValueError(case)


CASES = ["causal", "full", "packed", "ring_earlier_chunk", "ring_diagonal",
         "load_balanced_local", "load_balanced_ring_step", "load_balanced_gathered"]


def _schedule(case):
    q_pos, kv_pos, q_seg, kv_seg, causal = _layout(case)
    pb = pallas._Problem(1, HQ, HKV, q_pos.shape[1], kv_pos.shape[1], 16, BLOCK, BLOCK)
    prefetch = prefetch_arrays(*(jnp.asarray(x) for x in (q_pos, kv_pos, q_seg, kv_seg)),
                               BLOCK, BLOCK, causal)
    return pb, prefetch, causal


def _walk(grid, locator, prefetch, causal):
    """Grid indices of every step in grid order, and (Step, computed) of each."""
    ids = tuple(jnp.asarray(x) for x in np.indices(grid).reshape(len(grid), -1))
    step, some, _ = step_visibility(prefetch, locator, causal, *ids)
    return ids, step, np.asarray(some)


def _block_indices(spec, ids, prefetch):
    """[steps, rank]: the operand's block index at every step, from its index map."""
    n = ids[0].shape[0]
    return np.stack([np.broadcast_to(np.asarray(x), (n,))
                     for x in spec.index_map(*ids, *prefetch)], axis=-1)


def _changes(blocks):
    return int(np.any(blocks[1:] != blocks[:-1], axis=-1).sum())


def _copy_figures(spec, ids, prefetch, computed):
    """(copies, computed steps, reuses) of one operand over the grid."""
    blocks = _block_indices(spec, ids, prefetch)
    return 1 + _changes(blocks), int(computed.sum()), int(computed.sum()) - 1 - _changes(
        blocks[computed])


def _visible_pairs(pb, prefetch, causal):
    some, _ = pair_visibility(prefetch.q_bounds, prefetch.kv_bounds, 0,
                              jnp.arange(pb.nq)[:, None], jnp.arange(pb.nkv)[None, :],
                              pb.nq, pb.nkv, causal)
    return np.asarray(some)


@pytest.mark.parametrize("grid_kind", ["query_major", "key_major"])
@pytest.mark.parametrize("case", CASES)
def test_skipped_blocks_are_not_copied(case, grid_kind):
    """Over the forward's grid (k, v, kv id rows) or the backward's (q, dout, lse,
    delta, q id rows): copies == computed steps - reuses, for every operand; each
    visible (q block, kv block) pair is computed exactly once per query head. (The
    backward's dq blocks move by manual DMA, once each way per computed step.)"""
    pb, prefetch, causal = _schedule(case)
    grid, locator, specs = getattr(pb, grid_kind)()
    ids, step, computed = _walk(grid, locator, prefetch, causal)

    visible = _visible_pairs(pb, prefetch, causal)
    for head in range(HQ):
        mine = computed & (np.asarray(step.q_head) == head)
        pairs = list(zip(np.asarray(step.q_block)[mine], np.asarray(step.kv_block)[mine]))
        assert len(pairs) == len(set(pairs)) == visible.sum()
        assert all(visible[i, j] for i, j in pairs)

    operands = ((specs.kv, specs.kv_row) if grid_kind == "query_major"
                else (specs.q, specs.stat_row, specs.q_row))
    for spec in operands:
        copies, n_computed, reuses = _copy_figures(spec, ids, prefetch, computed)
        assert copies == n_computed - reuses, (copies, n_computed, reuses)


def _matmuls(jaxpr):
    """dot_general equations in a jaxpr, sub-jaxprs included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    count += _matmuls(sub)
    return count


def _kernel_bodies(jaxpr):
    """{pallas_call name: kernel jaxpr} anywhere in a jaxpr."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found[eqn.params["name"]] = eqn.params["jaxpr"]
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", param)
            if hasattr(sub, "eqns"):
                found.update(_kernel_bodies(sub))
    return found


def _matmuls_per_pair(kernel):
    """Matmuls of one computed block pair: each kernel computes a pair in one of two
    branches (masked, unmasked), which must hold the same matmuls."""
    counts = [_matmuls(branch.jaxpr) for eqn in kernel.eqns if eqn.primitive.name == "cond"
              for branch in eqn.params["branches"]]
    computing = [c for c in counts if c]
    assert len(computing) == 2 and computing[0] == computing[1], counts
    return computing[0]


def test_backward_matmuls_per_block_pair():
    """From the traced VJP's kernel bodies: the fused backward computes one (q block,
    kv block) pair with 5 matmuls (sT = k q^T, dpT = v do^T, dv += pT do, dk += dsT q,
    dq += dsT^T k; two kernels, dq's and dk/dv's, would recompute sT and dpT: 7), the
    forward with 2 (s, p v)."""
    s = 64
    x = jnp.ones((1, s, 2, 16))
    pos, seg = np.arange(s, dtype=np.int32)[None], np.zeros((1, s), np.int32)

    def loss(q, k, v):
        out, lse = pallas.flash_attention(q, k, v, pos, pos, seg, seg, block_q=32,
                                          block_kv=32)
        return jnp.sum(out) + jnp.sum(lse)

    kernels = _kernel_bodies(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x).jaxpr)
    per_pair = {name: _matmuls_per_pair(body) for name, body in kernels.items()}
    assert per_pair == {"lctrain_flash_forward": 2, "lctrain_flash_backward": 5}
