"""parallel/ring.py on its own, against the dense reference (tests/reference.py): its
gradients at every shape its steps take (c = 1, 2, 3 have no middle scan), bf16 inputs
with the dK/dV sums on the wire in ring.DKV_TRANSPORT_DTYPE, the sends of its traced
program counted (c-1 of each), the dK/dV sums added only inside the Pallas kernel (the
own chunk last), and (slow, libtpu) the compiled TPU schedule: each step's
sends in flight across its kernel.

The strategy-level equivalence (the model's loss and gradients on every mesh) is
tests/test_strategies.py.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lctrain.kernels.jaxpr_walk import equations
from lctrain.parallel import ring
from lctrain.parallel.strategy import load_balanced_order
from helpers import fast_jit
from reference import dense_attention

B, HQ, HKV, D = 2, 4, 2, 32
HEADS, TOKENS = P(None, "context", None, None), P(None, "context")
XLA_KERNEL = tuple(sorted(dict(impl="xla", block_q=32, block_kv=32).items()))


def ring_on(mesh, kernel_options):
    """Ring attention over the mesh axis 'context', on global [b, s, h, d] arrays."""
    def local(q, k, v, positions, segment_ids):
        return ring.ring_attention(q, k, v, positions, segment_ids, "context", kernel_options)

    return jax.shard_map(local, mesh=mesh, in_specs=(HEADS, HEADS, HEADS, TOKENS, TOKENS),
                         out_specs=HEADS, check_vma=False)


def context_mesh(c):
    return Mesh(np.array(jax.devices()[:c]), ("context",), axis_types=(AxisType.Auto,))


def inputs(seq, dtype):
    """q, k, v (N(0, 1) in `dtype`), an f32 cotangent, positions, and segment ids: row 0
    packs three documents, row 1 is one."""
    rng = np.random.default_rng(0)

    def normal(heads):
        return rng.standard_normal((B, seq, heads, D), dtype=np.float32)

    q, k, v = (jnp.asarray(normal(h), dtype) for h in (HQ, HKV, HKV))
    segment_ids = np.ones((B, seq), np.int32)
    segment_ids[0, seq // 3:] = 2
    segment_ids[0, 2 * seq // 3:] = 3
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (B, seq))
    return q, k, v, jnp.asarray(normal(HQ)), positions, segment_ids


def ring_and_dense_grads(c, seq, dtype, load_balance):
    """(dq, dk, dv) of the ring over c devices and of the dense f32 reference, as f32."""
    q, k, v, dout, positions, segment_ids = inputs(seq, dtype)
    attend = ring_on(context_mesh(c), XLA_KERNEL)

    def grads(q, k, v, dout, positions, segment_ids):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, positions, segment_ids), q, k, v)
        return vjp(dout.astype(out.dtype))

    order = load_balanced_order(seq, c) if load_balance else np.arange(seq)
    args = [x[:, order] for x in (q, k, v, dout, positions, segment_ids)]
    # f32: XLA:CPU's cheap optimization level (helpers.FAST_COMPILE), which keeps the
    # dtypes; bf16 at the default level, whose fusions the bf16 bounds were measured with.
    stored = (fast_jit(grads, *args) if dtype == jnp.float32 else jax.jit(grads))(*args)
    ours = [np.asarray(g, np.float32)[:, np.argsort(order)] for g in stored]

    def dense(q, k, v):
        return dense_attention(q, k, v, positions, positions, segment_ids, segment_ids)[0]

    _, vjp = jax.vjp(dense, *(x.astype(jnp.float32) for x in (q, k, v)))
    return ours, [np.asarray(g) for g in vjp(dout)]


@pytest.mark.parametrize("c", [1, 2, 3])
def test_f32_gradients_match_dense_for_short_rings(c):
    """Rings too short for the backward's middle scan (c = 1: no send at all). The
    natural order, so that steps with only causal-future keys are skipped."""
    ours, dense = ring_and_dense_grads(c, 96, jnp.float32, load_balance=False)
    for name, got, want in zip(("dq", "dk", "dv"), ours, dense):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("c", [4, 8])
def test_bf16_gradients_within_bf16_rounding_of_dense(c):
    """bf16 q, k, v against the f32 reference on the same rounded inputs. Measured max
    error / max |reference| with f32 sums on the wire: 3.6e-3 (dq), 5.1e-3 (dk), 6.1e-3
    (dv); bf16 sums move dk, dv by one bf16 step at most (see ring.DKV_TRANSPORT_DTYPE)."""
    ours, dense = ring_and_dense_grads(c, 256, jnp.bfloat16, load_balance=True)
    for name, got, want in zip(("dq", "dk", "dv"), ours, dense):
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < 1e-2, (name, error)


def ppermutes(jaxpr):
    """Operands sent by ppermute in `jaxpr` and every program it calls, counted once per
    execution (a scan's body `length` times), keyed by (shape, dtype)."""
    counted = Counter()
    for eqn, times in equations(jaxpr):
        if eqn.primitive.name == "ppermute":
            counted.update({(v.aval.shape, v.aval.dtype.name): times for v in eqn.invars})
    return counted


@pytest.mark.parametrize("c", [2, 4, 8])
def test_c_minus_1_sends_of_each(c):
    """Forward and backward each pass K, V and the ids (positions and segment ids, one
    array) c-1 times; the backward passes the dK and dV sums c-1 times each, the last
    hop bringing it home."""
    seq = 16 * c
    q, k, v, dout, positions, segment_ids = inputs(seq, jnp.bfloat16)
    attend = ring_on(context_mesh(c), XLA_KERNEL)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, positions, segment_ids).astype(jnp.float32) * dout)

    sent = ppermutes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    chunk = seq // c
    transport = jnp.dtype(ring.DKV_TRANSPORT_DTYPE).name
    assert sent == {((B, chunk, HKV, D), "bfloat16"): 2 * 2 * (c - 1),    # K and V
                    ((2, B, chunk), "int32"): 2 * (c - 1),                 # ids
                    ((B, chunk, HKV, D), transport): 2 * (c - 1)}          # dK, dV sums


def f32_adds(jaxpr, shapes):
    """How many f32 `add`s of one of `shapes` `jaxpr` and the programs it calls hold
    (each program counted once, a scan's body too)."""
    return sum(eqn.primitive.name in ("add", "add_any")
               and eqn.outvars[0].aval.dtype == jnp.float32
               and eqn.outvars[0].aval.shape in shapes for eqn, _ in equations(jaxpr))


@pytest.mark.parametrize("c", [2, 4])
def test_dkv_sums_are_added_only_inside_the_pallas_kernel(c):
    """The backward attends the chip's own chunk last, into the dK/dV sum that came home:
    with the Pallas kernel (which adds into the sum it is given) the ring adds no f32
    K-sized pair itself. Own chunk first, its f32 dK/dV would wait through every step and
    be added to the sum at the end (what that costs at 1M tokens on 4 chips:
    benchmarks/RESULTS.md's first table)."""
    seq = 128 * c
    q, k, v, dout, positions, segment_ids = inputs(seq, jnp.bfloat16)
    k_shapes = {(B, seq // c, HKV, D), (B, HKV, seq // c, D)}  # either layout

    def adds_in_backward(kernel_options):
        attend = ring_on(context_mesh(c), kernel_options)

        def loss(q, k, v):
            return jnp.sum(attend(q, k, v, positions, segment_ids).astype(jnp.float32) * dout)

        return f32_adds(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr,
                        k_shapes)

    assert adds_in_backward(tuple(sorted(dict(impl="pallas", block_q=128,
                                              block_kv=128).items()))) == 0
    assert adds_in_backward(XLA_KERNEL) > 0  # it adds after its kernel: the count sees it


# ------------------------------------------------------ compiled TPU schedule ----

def _computations(hlo: str) -> dict[str, list[str]]:
    """The HLO text's computations: name -> instruction lines, in scheduled order."""
    computations, lines = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            computations[header.group(1)] = lines = []
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return computations


def _running_kernels(computations: dict[str, list[str]]) -> set[str]:
    """Names of the computations that run a Mosaic kernel, themselves or in one they call."""
    running = {name for name, lines in computations.items()
               if any('custom_call_target="tpu_custom_call"' in line for line in lines)}
    grew = True
    while grew:
        grew = False
        for name, lines in computations.items():
            if name not in running and any(callee in running for line in lines
                                           for callee in _callees(line)):
                running.add(name)
                grew = True
    return running


def _callees(line: str) -> set[str]:
    called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                        r"(\{[^}]*\}|%[\w.\-]+)", line)
    return set(re.findall(r"%([\w.\-]+)", " ".join(called)))


def sends_across_kernels(hlo: str):
    """([sends in flight across each forward kernel], [the same for the backward], number
    of sends in flight across no kernel of their own pass), in scheduled order. A kernel
    is the ring step's conditional (the skip) that runs it; its sends are the
    collective-permutes of its own pass (jax's op_name marks the backward 'transpose(')."""
    computations = _computations(hlo)
    running = _running_kernels(computations)
    passes = {"forward": [], "backward": []}
    idle = set()
    for lines in computations.values():
        in_flight = {}
        for line in lines:
            pass_ = "backward" if "transpose(" in line else "forward"
            if " collective-permute-start(" in line:
                start = re.match(r"\s*%(\S+) =", line).group(1)
                in_flight[start] = pass_
                idle.add(start)
            elif " collective-permute-done(" in line:
                in_flight.pop(re.search(r"collective-permute-done\(%(\S+)\)", line).group(1))
            elif " conditional(" in line and _callees(line) & running:
                across = {start for start, p in in_flight.items() if p == pass_}
                passes[pass_].append(len(across))
                idle -= across
    return passes["forward"], passes["backward"], len(idle)


@pytest.mark.slow
def test_each_step_sends_across_its_kernel_on_tpu():
    """The ring's VJP with our Pallas kernels (Mosaic custom calls) compiled for v5p 2x2x1
    (c = 4): in the forward, the scan's step (run c-1 times) has K, V and the ids in
    flight across its kernel, the last step sends nothing. The backward attends the other
    chips' chunks first and its own last (parallel/ring.py): the first K/V hop goes before
    any kernel, steps 1 and 2 send K, V, ids across theirs, step 3 and the own chunk
    send none. The dK and dV sums are not in flight across any kernel: the kernel adds
    into the sum that arrived, so their c-1 hops, two arrays each, finish before the
    kernels. Idle: those 6 and the first K/V hop's 3."""
    from tpu_aot import tpu_mesh

    mesh = tpu_mesh("v5p:2x2x1", {"data": 1, "fsdp": 1, "context": 4, "tensor": 1})
    kernel = tuple(sorted(dict(impl="pallas", block_q=128, block_kv=128, platform="tpu",
                               run_tokens=None).items()))
    attend = ring_on(mesh, kernel)

    def grads(q, k, v, positions, segment_ids, dout):
        _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, positions, segment_ids), q, k, v)
        return vjp(dout)

    def abstract(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    seq, heads = 2048, 4
    q = abstract((1, seq, heads, 128), jnp.bfloat16, HEADS)
    kv = abstract((1, seq, 2, 128), jnp.bfloat16, HEADS)
    ids = abstract((1, seq), jnp.int32, TOKENS)
    hlo = jax.jit(grads).lower(q, kv, kv, ids, ids, q).compile().as_text()
    forward, backward, idle = sends_across_kernels(hlo)
    assert sorted(forward) == [0, 3]
    assert backward == [3, 3, 0, 0]
    assert idle == 2 * 3 + 3
