"""The gated delta rule (kernels/gdn.py) and its context-parallel form
(parallel/state_passing.py): the chunked kernel against the token-by-token recurrence and
against transformers' Qwen3-Next reference (PyTorch, f32), its custom VJP against
autodiff of the recurrence, packed documents, and the state passing on 2 and 4 of the
suite's fake CPU devices against one device, values and gradients; its all-gather
bytes (at two sequence lengths) and its FLOPs against the cost model.

Inputs: 2 rows, 2 key heads of 16 and 4 value heads of 8 (Qwen3-Next's GQA-like split),
g in [-0.5, 0], beta in (0, 1), as the model's softplus and sigmoid give them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import assert_close, fast_jit
from lctrain.kernels.gdn import (final_state, gated_delta_rule, recurrent_gated_delta_rule,
                                 reset_at_document_starts)
from lctrain.kernels.jaxpr_walk import equations
from lctrain.parallel.cost_model import Dims
from lctrain.parallel.hlo import collective_bytes
from lctrain.parallel.state_passing import (StatePassing, state_passing_extra_flops,
                                          state_passing_traffic)
from lctrain.recipes import load_recipe
from lctrain.trainer.state.build import mesh_for

B, HK, HV, DK, DV = 2, 2, 4, 16, 8
TOL = 1e-5
# Jitted: one compile each rather than one per operation.
recurrent = jax.jit(recurrent_gated_delta_rule)


@functools.cache
def chunked(chunk):
    return jax.jit(functools.partial(gated_delta_rule, chunk=chunk))


def inputs(seq, seed=0):
    """q, k, v, g, beta, an initial state, and cotangents for out and the final state."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, seq, HK, DK), np.float32) for _ in range(2))
    v = rng.standard_normal((B, seq, HV, DV), np.float32)
    g = -0.5 * rng.random((B, seq, HV), np.float32)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, seq, HV), np.float32)))
    state = rng.standard_normal((B, HV, DK, DV), np.float32)
    d_out = rng.standard_normal((B, seq, HV, DV), np.float32)
    d_final = rng.standard_normal((B, HV, DK, DV), np.float32)
    return q, k, v, g, beta, state, d_out, d_final


def packed_positions(seq):
    """Row 0 packs documents starting at 0, 5 and 2 seq / 3 (a start mid-chunk and one
    on a device boundary at 2 or 4 devices when seq = 48); row 1 is one document."""
    starts = np.zeros((B, seq), bool)
    starts[:, 0] = True
    starts[0, [5, 2 * seq // 3]] = True
    index = np.arange(seq)
    latest = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return (index - latest).astype(np.int32)


def assert_named_close(got, want, names):
    """The arrays of `got` and `want`, named in order by `names`, within TOL."""
    assert_close(dict(zip(names, got)), dict(zip(names, want)), TOL, rtol=TOL)


@pytest.mark.parametrize("chunk, seq", [(4, 48), (16, 50), (64, 50), (64, 130)])
def test_chunked_matches_recurrence(chunk, seq):
    """Chunks of 4 to 64, lengths that are and are not multiples, from a given state."""
    q, k, v, g, beta, state, *_ = inputs(seq)
    got = chunked(chunk)(q, k, v, g, beta, initial_state=state)
    want = recurrent(q, k, v, g, beta, initial_state=state)
    assert_named_close(got, want, ("out", "final state"))


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_matches_transformers(chunk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule)
    q, k, v, g, beta, state, *_ = inputs(70)
    out, final = torch_chunk_gated_delta_rule(
        *(torch.from_numpy(x) for x in (q, k, v, g, beta)), chunk_size=chunk,
        initial_state=torch.from_numpy(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    got = chunked(chunk)(q, k, v, g, beta, initial_state=state)
    assert_named_close(got, (out.numpy(), final.numpy()), ("out", "final state"))


def test_document_starts_reset_the_state():
    """g = -inf at document starts: the chunked form equals the recurrence (whose exp(-inf)
    zeroes the state), and each document alone from a zero state."""
    seq = 48
    q, k, v, g, beta, state, *_ = inputs(seq)
    g = reset_at_document_starts(g, packed_positions(seq))
    out, final = chunked(16)(q, k, v, g, beta, initial_state=state)
    assert_named_close((out, final), recurrent(q, k, v, g, beta, initial_state=state),
                       ("out", "final state"))
    alone = chunked(16)(*(x[:1, 5:32] for x in (q, k, v, g, beta)))[0]
    np.testing.assert_allclose(out[:1, 5:32], alone, atol=TOL)


def gradients(rule, q, k, v, g, beta, state, d_out, d_final):
    """(out, final state, and the gradients of all six inputs) under the cotangents."""
    (out, final), vjp = jax.vjp(lambda *x: rule(*x[:5], initial_state=x[5]),
                                q, k, v, g, beta, state)
    return (out, final, *vjp((d_out, d_final)))


GRADIENT_NAMES = ("out", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state")


@pytest.mark.parametrize("packed", [False, True])
def test_custom_vjp_matches_autodiff_of_recurrence(packed):
    seq = 40
    q, k, v, g, beta, *rest = inputs(seq)
    if packed:
        g = np.asarray(reset_at_document_starts(g, packed_positions(seq)))
    args = (q, k, v, g, beta, *rest)
    got = fast_jit(functools.partial(gradients, chunked(16)), *args)(*args)
    want = fast_jit(functools.partial(gradients, recurrent), *args)(*args)
    assert_named_close(got, want, GRADIENT_NAMES)
    if packed:  # the gates at document starts get no gradient, as in the recurrence
        assert not np.asarray(got[5])[np.isneginf(g)].any()


def test_final_state_widens_the_values_in_the_kernel():
    """final_state with a state d_k columns wider than the values (state passing's first
    pass) against the recurrence given the widened values [0 | v] whole: the final
    state, and its gradient to k, v, g, beta and the initial state."""
    seq = 40
    q, k, v, g, beta, state, _, _ = inputs(seq)
    rng = np.random.default_rng(1)
    wide_state = rng.standard_normal((B, HV, DK, DK + DV), np.float32)
    d_final = rng.standard_normal((B, HV, DK, DK + DV), np.float32)

    def loss(fn, k, v, g, beta, state):
        return jnp.sum(fn(k, v, g, beta, state) * d_final)

    def ours(k, v, g, beta, state):
        return final_state(k, v, g, beta, chunk=16, initial_state=state)

    def reference(k, v, g, beta, state):
        widened = jnp.concatenate([jnp.zeros((*v.shape[:-1], DK)), v], axis=-1)
        return recurrent_gated_delta_rule(q, k, widened, g, beta, initial_state=state)[1]

    def value_and_grads(fn):  # jitted: one compile, not one per operation
        grads = jax.grad(functools.partial(loss, fn), argnums=range(5))
        return jax.jit(lambda *x: (fn(*x), grads(*x)))(k, v, g, beta, wide_state)

    (got, got_grads), (want, want_grads) = value_and_grads(ours), value_and_grads(reference)
    assert_named_close([got], [want], ["final state"])
    names = ("dk", "dv", "dg", "dbeta", "d initial state")
    assert_named_close(got_grads, want_grads, names)


def strategy_for(context, load_balance, extra=()):
    sets = ["parallel.strategy=ring", f"parallel.load_balance={load_balance}", "mesh.data=1",
            f"mesh.context={context}", f"data.batch_size={B}", *extra]
    recipe = load_recipe("tiny", sets)
    strategy = StatePassing(recipe, mesh_for(recipe, jax.devices()[:context]))
    strategy.chunk = 4  # several kernel chunks per run
    return strategy


def context_parallel_gradients(strategy, seq):
    """gradients() of strategy.delta_rule on packed rows, computed in the stored order
    and put back in sequence order (the initial state is zero: no d initial state)."""
    q, k, v, g, beta, _, d_out, _ = inputs(seq)
    positions = packed_positions(seq)
    order = strategy.sequence_order(seq)
    order = np.arange(seq) if order is None else order

    def rule(q, k, v, g, beta, positions, d_out):
        out, vjp = jax.vjp(lambda *x: strategy.delta_rule(*x, positions), q, k, v, g, beta)
        return (out, *vjp(d_out))

    args = [x[:, order] for x in (q, k, v, g, beta, positions, d_out)]
    stored = fast_jit(rule, *args)(*args)
    return [np.asarray(x)[:, np.argsort(order)] for x in stored]


@functools.cache
def one_device_gradients(seq):
    """What context_parallel_gradients should give: the kernel on one device."""
    q, k, v, g, beta, _, d_out, _ = inputs(seq)
    g = reset_at_document_starts(g, packed_positions(seq))
    out, vjp = jax.vjp(lambda *x: chunked(16)(*x)[0], q, k, v, g, beta)
    return (out, *vjp(d_out))


# (devices, load balance, extra recipe keys): one run of 24 tokens per device, two of 6,
# and two of 6 over a mesh that splits the sequence over context x ulysses (48 tokens).
CONTEXT_CASES = [(2, False, []), (4, True, []),
                 (4, True, ["parallel.strategy=usp", "parallel.ulysses=2"])]


@pytest.mark.parametrize("context, load_balance, extra", CONTEXT_CASES)
def test_state_passing_matches_one_device(context, load_balance, extra):
    strategy = strategy_for(context, load_balance, extra)
    assert_named_close(context_parallel_gradients(strategy, 48), one_device_gradients(48),
                       ("out", "dq", "dk", "dv", "dg", "dbeta"))


def state_passing_gather_bytes(seq):
    """All-gather bytes one device receives in the compiled (CPU) forward and backward of
    delta_rule, 4 devices, load-balanced; and that no other collective runs."""
    strategy = strategy_for(4, True)
    q, k, v, g, beta, _, d_out, _ = inputs(seq)
    positions = np.zeros((B, seq), np.int32)

    def rule(q, k, v, g, beta, d_out):
        out, vjp = jax.vjp(lambda *x: strategy.delta_rule(*x, positions), q, k, v, g, beta)
        return (out, *vjp(d_out))

    hlo = jax.jit(rule).lower(q, k, v, g, beta, d_out).compile().as_text()
    counted = collective_bytes(hlo).bytes_by_kind
    assert sum(counted.values()) == counted["all-gather"], counted
    return counted["all-gather"]


def test_state_passing_traffic_is_independent_of_sequence_length():
    """Two runs per device: the forward gathers 3 other devices' f32 [A | B], [B, HV, DK,
    DK + DV] per run, the backward their start states' gradients, [B, HV, DK, DV]; the same
    at 64 and 256 tokens, and the cost model (one forward pass) agrees."""
    maps, grads = (3 * 2 * B * HV * DK * width * 4 for width in (DK + DV, DV))
    assert state_passing_gather_bytes(64) == state_passing_gather_bytes(256) == maps + grads
    assert state_passing_traffic(B, HV, DK, DV, 4, 2, 1, 1) == {
        "strategy_state_maps": ("all-gather", maps),
        "strategy_state_grads": ("all-gather", grads)}
    dims = Dims(b=B, rows=B, accum=1, s=64, c=4, u=1, r=1, t=1, z=4, g=4, p=4, e=64, h=HV,
                kv=HK, d=DK, f=256, v=256, layers=3, remat="full", context_kept=False)
    state = 3 * 2 * B * HV * DK * DK * 4  # d_v = d_k = dims.d
    assert StatePassing.traffic(dims) == {
        "strategy_state_maps": ("all-gather", 2 * 3 * 2 * state),
        "strategy_state_grads": ("all-gather", 3 * state)}


def traced_flops(fn, *args):
    """Matmul and triangular-solve FLOPs in fn's jaxpr (a solve of an m x m system for n
    columns as m^2 n), loops times their trip counts, shard_map bodies per device."""
    total = 0
    for eqn, times in equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += times * 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod(
                [lhs[i] for i in contracting])
        elif eqn.primitive.name == "triangular_solve":
            *batch, m, n = eqn.invars[1].aval.shape
            total += times * np.prod(batch) * m * m * n
    return total


def test_extra_flops_are_the_widened_state_and_the_fold():
    """The forward on 4 devices (load-balanced, 64 tokens: two runs of 8 per device, in
    chunks of 4) against one device's kernel on its 16 tokens: the difference is the
    cost model's extra FLOPs (a fifth of a step's with one forward pass)."""
    strategy, seq = strategy_for(4, True), 64
    q, k, v, g, beta, *_ = inputs(seq)
    positions = packed_positions(seq)
    split = traced_flops(lambda *x: strategy.delta_rule(*x, positions), q, k, v, g, beta)
    local = (x[:, :seq // 4] for x in (q, k, v, g, beta))
    alone = traced_flops(lambda *x: gated_delta_rule(*x, chunk=4)[0], *local)
    assert split - alone == state_passing_extra_flops(
        B, HV, DK, DV, seq // 4, 4, 2, 4, 1, 1) / 5
