"""What a linear (Gated DeltaNet) layer asks of the mesh: the causal conv over q, k, v and
the gated delta rule, on each device's share of the sequence (trainer/model/gdn_layer.py calls
it as its `mix`).

The conv (kernels/causal_conv.py) needs the kernel-1 tokens before each of the device's
runs (one run, or two with load balancing: chunks i and 2c-1-i). Like parallel/halo.py's
sends: run i's come from rank i-1's first run (a lax.ppermute to the next rank), run
2c-1-i's from rank i+1's second (to the previous rank), but rank c-1's second run follows
its own first, which it holds. The permutations are cyclic; the conv drops the tokens of
the wrong end of the sequence by their sequence index, and taps of other documents by
their segment id. Traffic per layer: kernel-1 tokens of q, k, v per run, whatever the
sequence length; autodiff turns each send into the reverse send of their gradients.

The delta rule is state_passing's (parallel/state_passing.local_delta_rule): it restarts
at every document (position 0) and passes the runs' states over the sequence axes. On a
mesh whose sequence is not split (strategy none) the same code runs with one run and no
sends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lctrain.kernels.causal_conv import causal_conv
from lctrain.parallel.halo import PAD_POSITION, PAD_SEGMENT
from lctrain.parallel.state_passing import (GATES_SPEC, SEQUENCE_AXES, local_delta_rule,
                                            rows_as_runs, runs_as_rows)
from lctrain.parallel.strategy import HEADS_SPEC, TOKENS_SPEC, ContextStrategy

CONV_SPEC = P(None, "tensor", None)   # [kernel, heads, head_dim]


def linear_mix(strategy: ContextStrategy, chunk: int, q, k, v, conv_weights, g, beta,
               positions, segment_ids):
    """q, k [b, s, h_k, d_k] and v [b, s, h_v, d_v] before the conv; conv_weights (q's,
    k's, v's) [kernel, heads, head_dim]; g, beta [b, s, h_v]; positions (in the document)
    and segment ids [b, s]: global-shape arrays in the stored order -> the delta rule's
    out [b, s, h_v, d_v]."""
    runs = 2 if strategy.load_balance else 1
    per_device = jax.shard_map(
        functools.partial(_local_mix, runs=runs, chunk=chunk), mesh=strategy.mesh,
        in_specs=(HEADS_SPEC,) * 3 + ((CONV_SPEC,) * 3,) + (GATES_SPEC,) * 2
        + (TOKENS_SPEC,) * 3,
        out_specs=HEADS_SPEC, check_vma=False)
    return per_device(q, k, v, tuple(conv_weights), g, beta, positions,
                      strategy.sequence_indices(positions.shape), segment_ids)


def _local_mix(q, k, v, conv_weights, g, beta, positions, index, segment_ids, runs, chunk):
    """One device's share: conv and SiLU over q, k, v (one array of their features, so
    one send), then the delta rule."""
    widths = [x.shape[2] * x.shape[3] for x in (q, k, v)]
    features = jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in (q, k, v)], axis=-1)
    weight = jnp.concatenate([w.reshape(w.shape[0], -1) for w in conv_weights], axis=-1)
    mixed = _conv_with_halos(features, weight, index, segment_ids, runs).astype(v.dtype)
    q, k, v = (part.reshape(x.shape) for part, x in
               zip(jnp.split(mixed, [widths[0], widths[0] + widths[1]], axis=-1), (q, k, v)))
    return local_delta_rule(q, k, v, g, beta, positions, runs, chunk)


def _conv_with_halos(x, weight, index, segment_ids, runs):
    """The conv of this device's [b, n, F] tokens, each run preceded by the kernel-1
    tokens before it (module docstring)."""
    width = weight.shape[0] - 1
    rows = [runs_as_rows(a, runs) for a in (x, jnp.stack([index, segment_ids], axis=-1))]
    if width:
        halos = _preceding_tokens(rows, width, runs)
        rows = [jnp.concatenate([halo, own], axis=1) for halo, own in zip(halos, rows)]
    out = causal_conv(rows[0], weight, rows[1][..., 0], rows[1][..., 1])
    return rows_as_runs(out, runs)


def _preceding_tokens(rows, width, runs):
    """For each run (rows run major) the `width` tokens before it of both `rows`
    (features; sequence index and segment id), or padding no tap takes where the
    sequence is not split."""
    size = jax.lax.axis_size(SEQUENCE_AXES)
    if size == 1:
        features, ids = rows
        return [jnp.zeros((features.shape[0], width, features.shape[2]), features.dtype),
                jnp.broadcast_to(jnp.array([PAD_POSITION, PAD_SEGMENT], ids.dtype),
                                 (ids.shape[0], width, 2))]
    tails = [a[:, -width:] for a in rows]
    b = rows[0].shape[0] // runs
    to_next = [(i, (i + 1) % size) for i in range(size)]
    received = [jax.lax.ppermute(tail[:b], SEQUENCE_AXES, to_next) for tail in tails]
    if runs == 1:
        return received
    to_previous = [(i, (i - 1) % size) for i in range(size)]
    last_rank = jax.lax.axis_index(SEQUENCE_AXES) == size - 1
    second = [jnp.where(last_rank, tail[:b],
                        jax.lax.ppermute(tail[b:], SEQUENCE_AXES, to_previous))
              for tail in tails]
    return [jnp.concatenate(pair, axis=0) for pair in zip(received, second)]
