"""ring: K/V travel around the chips of the context axis while each chip attends its queries.

Step t of c: chip i holds the K/V chunk of chip i-t, attends its own queries to it, and
folds the partial result into a running (out, logsumexp). The next chunk is sent on
before the step's kernel runs, so the transfer overlaps it; the last chunk to arrive is
not sent on (c-1 sends).

The backward pass is written by hand (custom VJP) so that memory stays O(s/c): the
forward keeps only q, k, v, out and logsumexp; the backward rotates K/V once more and
recomputes each step's gradients from the final out/logsumexp. It attends the other
chips' chunks first (steps 1 .. c-1) and its own chunk last. Chip j's dK/dV are summed on
the way round: the sum starts on chip j+1, which holds j's K/V at step 1, gains each
later chip's share and reaches chip j-1 at the last step; one more send brings it home,
where chip j's own chunk comes last and adds its share (c-1 sends, as for K/V). The sum
that arrives for a block is what the kernel adds the block's dK/dV into, in place and in
f32 (kernels without that add it right after), so a step waits for it before its
kernel: one f32 dK/dV buffer per step where adding after the kernel (the hop hidden
behind it) holds three, the sum going out, the one coming in and the fresh block. With
the own chunk first (as the forward does it), its f32 dK/dV waited through every other
step for the sum to come home, which cost recipes/llama3_8b_1m.yaml several GB per chip
(benchmarks/RESULTS.md, "llama3.1-8b on 4 v5p chips, against MaxText"). The
price is the first K/V hop of the backward, which no ring kernel hides (one bf16 K/V
chunk per layer), and the dK/dV hops each step waits for: 8 bytes per K/V element
against the kernel's 10 * chunk * (query heads / KV heads) flops, at 256K tokens per
chip under 1% of the kernel's time on v5p, at 8K about 12% (where the planner prefers
other strategies). Steps with nothing to attend (a chunk entirely in the causal future,
or with a sliding window entirely behind it) are skipped.

Layout: q, k, v, out and the gradients travel and accumulate in the kernel's own layout
(head-major for the Pallas kernels, kernels/layout.py), converted once per layer on the
way in and out, so no ring step relayouts what it sends or attends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lctrain import kernels
from lctrain.kernels.layout import (HEADS_MAJOR, TOKENS_MAJOR, convert, relayout, row_dot,
                                    tokens_major_shape)
from lctrain.kernels.masks import some_keys_visible
from lctrain.kernels.residuals import named_results
from lctrain.parallel.chips import Chip
from lctrain.parallel.cost_model import AttentionFootprint, Dims, RingTiming, Traffic
from lctrain.parallel.ring_cost import ring_attention_footprint, ring_timing, ring_traffic
from lctrain.parallel.strategy import CONTEXT_AXIS, ContextStrategy
from lctrain.recipes.schema import Recipe

# The dtype dK/dV partial sums cross the ring in; each chip adds in f32. bf16 would halve
# those bytes (the backward's sends: 4 instead of 6 K-sized bf16 units per step), but each
# hop rounds the running sum once more. Measured with bf16 q, k, v against the dense f32
# reference (tests/test_ring.py's inputs, 512 tokens), relative RMS error of dk / dv:
# f32 3.4e-3 / 3.3e-3 at c = 4 and 8 (the kernel's bf16 and the final rounding); bf16
# 3.6e-3 / 3.4e-3 at c = 4, 4.1e-3 / 3.8e-3 at c = 8, growing as sqrt(c-1) roundings.
# Max error / max |ref| moves by at most one bf16 step (5.1e-3 -> 5.7e-3 for dk at c = 8);
# the bf16 model's weight gradients against one device differ alike (8.6e-3 RMS either
# way at c = 8). f32: the error stays the kernel's at any c, and the extra bytes cost time
# only where a ring step's sends outlast its kernel, at short chunks, where the planner
# prefers other strategies.
DKV_TRANSPORT_DTYPE = jnp.float32


class Ring(ContextStrategy):
    name = "ring"
    simplicity = 4

    @classmethod
    def degrees(cls, context: int, ulysses: int) -> tuple[int, int]:
        return 1, context

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        return ring_attention_footprint(dm)

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        return ring_traffic(dm)

    @classmethod
    def ring_timing(cls, dm: Dims, chip: Chip) -> RingTiming:
        return ring_timing(dm, chip)

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        """A ring step: the device's chunk against another device's."""
        return (recipe.data.seq_len // axis_sizes["context"],) * 2

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        return ring_attention(q, k, v, positions, segment_ids, CONTEXT_AXIS,
                              ring_options(self.kernel_options, window))


def ring_options(kernel_options: dict, window: int | None) -> tuple:
    """The kernel options and the sliding window, as `ring_attention` takes them."""
    return tuple(sorted({**kernel_options, "window": window}.items()))


def ring_attention(q, k, v, positions, segment_ids, axis_name, kernel_options,
                   layout=TOKENS_MAJOR):
    """Causal attention of the local queries to the whole sequence spread over `axis_name`.

    `kernel_options` is a sorted tuple of (name, value) for `lctrain.kernels` (hashable,
    because it is a static argument of the custom VJP), the sliding `window` among them
    (`ring_options`). q, k, v and the result are in `layout` (kernels/layout.py).
    """
    return _ring(q, k, v, positions, segment_ids, axis_name, kernel_options, layout)


def _send_to_next(x, axis_name):
    size = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x, axis_name, perm=[(i, (i + 1) % size) for i in range(size)])


def _send_all(xs, axis_name, in_order: bool):
    """Each of `xs` to the next chip. With `in_order` each send starts once the one before
    it has arrived (see sends_in_order)."""
    sent = []
    for x in xs:
        if in_order and sent:
            x, _ = jax.lax.optimization_barrier((x, sent[-1]))
        sent.append(_send_to_next(x, axis_name))
    return tuple(sent)


def sends_in_order(options: dict) -> bool:
    """Whether a step's sends must run one after another: on XLA:CPU. jax lowers every
    collective of a shard_map with one channel id (1), and XLA:CPU's in-process
    communicator meets the devices of a collective-permute by that id, while its thunk
    executor runs independent permutes of one device concurrently; a device's K send can
    then meet another device's V send. Seen as losses that differ by ~2e-4 between runs of
    the same step (jax 0.10) and as a permute that never completes (jax 0.12: "Expected 3
    threads to join the rendezvous, but only 2 of them arrived"; tests/test_ring.py).
    On TPU and GPU each permute keeps its own channel and the sends overlap."""
    return options.get("platform", jax.default_backend()) == "cpu"


def _may_attend(q_positions, kv_positions, window):
    """False only when every key of the chunk lies in the causal future of every query
    or (with a sliding window) `window` or more positions behind every query."""
    return some_keys_visible(jnp.min(q_positions), jnp.max(q_positions),
                             jnp.min(kv_positions), jnp.max(kv_positions), True, window)


def kernel_layout(chunk_tokens: int, options: dict) -> str:
    """The layout a ring keeps q, k, v in: its kernel's, for one chunk against another."""
    return kernels.native_layout(chunk_tokens, chunk_tokens, **options)


def _merge(out, lse, block_out, block_lse, layout):
    """Combines two softmax-normalised partial results by their logsumexps."""
    new_lse = jnp.logaddexp(lse, block_lse)
    finite = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)  # rows with no key at all yet

    def weight(x):  # [b, h, s], laid out as head-major rows -> a factor for every row of out
        return convert(jnp.exp(x - finite), HEADS_MAJOR, layout)[..., None]

    return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), new_lse


def _tied(tensors):
    """The tensors, made to look to XLA as if each depended on all the others.

    Positions and segment ids are the same in every layer; anything computed from them
    alone (which ring steps to skip, the kernel's masks) XLA would hoist out of the layer
    loop and keep for every ring step at once. Tied to the layer's K/V they stay in it.

    Every ring step also starts and ends with a tie of all it carries: a send then cannot
    start before the step does (XLA would run the whole K/V rotation ahead, every chunk
    held at once), and what it delivers is first needed at the step's end, after the
    kernel, so XLA's scheduler keeps the transfer in flight across the kernel.
    """
    return jax.lax.optimization_barrier(tensors)


def _chunk(k, v, positions, segment_ids):
    """What travels for a K/V chunk: k, v and its token ids, positions and segment ids in
    one array. XLA keeps at most 5 collective-permutes in flight on TPU
    (xla_max_concurrent_async_collective_permutes): a middle backward step sends K, V, the
    ids, dK and dV, 5; with the ids as two arrays, one would wait for the others."""
    return k, v, jnp.stack([positions, segment_ids])


def _forward(q, k, v, positions, segment_ids, axis_name, kernel_options, given_layout):
    options = dict(kernel_options)
    layout = kernel_layout(positions.shape[1], options)
    b, s, h, d = tokens_major_shape(q.shape, given_layout)
    q, k, v = (relayout(x, given_layout, layout) for x in (q, k, v))
    q, positions, segment_ids = _tied((q, positions, segment_ids))

    def attend_and_merge(out, lse, k, v, ids):
        block = kernels.attention(q, k, v, q_positions=positions, kv_positions=ids[0],
                                  q_segment_ids=segment_ids, kv_segment_ids=ids[1],
                                  causal=True, return_lse=True, layout=layout, **options)
        return _merge(out, lse, *block, layout)

    def skip(out, lse, *_):
        return out, lse

    in_order = sends_in_order(options)

    def step(out, lse, kv, send):
        out, lse, kv = _tied((out, lse, kv))
        next_kv = _send_all(kv, axis_name, in_order) if send else None
        # The skipped branch hands the running result through: a branch that made a
        # constant block (zeros, -inf) would be hoisted out of the layer loop by XLA, one
        # q-sized buffer per ring step kept for the whole step.
        out, lse = jax.lax.cond(_may_attend(positions, kv[2][0], options.get("window")),
                                attend_and_merge, skip, out, lse, *kv)
        return _tied((out, lse, next_kv))

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, h, s), -jnp.inf, jnp.float32),
            _chunk(k, v, positions, segment_ids))
    carry, _ = jax.lax.scan(lambda carry, _: (step(*carry, send=True), None), init,
                            length=jax.lax.axis_size(axis_name) - 1)
    out, lse, _ = step(*carry, send=False)
    return relayout(out.astype(q.dtype), layout, given_layout), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, positions, segment_ids, axis_name, kernel_options, given_layout):
    return _forward(q, k, v, positions, segment_ids, axis_name, kernel_options,
                    given_layout)[0]


def _ring_fwd(q, k, v, positions, segment_ids, axis_name, kernel_options, given_layout):
    out, lse = named_results(*_forward(q, k, v, positions, segment_ids, axis_name,
                                       kernel_options, given_layout))
    return out, (q, k, v, positions, segment_ids, out, lse)


def _ring_bwd(axis_name, kernel_options, given_layout, residuals, dout):
    q, k, v, positions, segment_ids, out, lse = residuals
    options = dict(kernel_options)
    layout = kernel_layout(positions.shape[1], options)
    size = jax.lax.axis_size(axis_name)
    q, k, v, out, dout = (relayout(x, given_layout, layout) for x in (q, k, v, out, dout))
    q, positions, segment_ids = _tied((q, positions, segment_ids))

    def attend(dq, k, v, ids, arrived):
        # delta is recomputed per step from out (a row sum; its reads are small next to
        # the kernel's). Computed once before the steps, out would die early and the
        # live set shrink by a q-sized buffer, yet XLA's TPU allocator packs the program
        # worse: recipes/llama3_8b_1m.yaml compiled to more that way (benchmarks/
        # RESULTS.md, "llama3.1-8b on 4 v5p chips, against MaxText").
        delta = row_dot(out, dout, layout)
        dq, dk, dv = kernels.attention_block_backward(
            q, k, v, delta, lse, dout, q_positions=positions, kv_positions=ids[0],
            q_segment_ids=segment_ids, kv_segment_ids=ids[1], causal=True, layout=layout,
            dq_sum=dq, dkv_sum=arrived, **options)
        return dq, (dk.astype(jnp.float32), dv.astype(jnp.float32))

    def skip(dq, k, v, ids, arrived):
        return dq, arrived or tuple(jnp.zeros(k.shape, jnp.float32) for _ in range(2))

    in_order = sends_in_order(options)

    def step(dq, kv, partial, send_kv):
        """Returns dq, the next K/V chunk and this block's dK/dV (f32) plus the sum that
        arrived for them; `partial` is the sum to pass on, None when none."""
        dq, kv, partial = _tied((dq, kv, partial))
        wire = _on_the_wire(partial)
        outgoing = (kv if send_kv else ()) + wire
        sent = _send_all(outgoing, axis_name, in_order)
        next_kv = sent[:len(kv)] if send_kv else None
        arrived = tuple(x.astype(jnp.float32) for x in sent[len(outgoing) - len(wire):]) or None
        dq, summed = jax.lax.cond(_may_attend(positions, kv[2][0], options.get("window")),
                                  attend, skip, dq, *kv, arrived)
        return _tied((dq, next_kv, summed))

    # Zeros XLA may make early, holding 4 GiB per chip through the work before the
    # first kernel at 1M tokens on 4 chips. Made from a result of that work instead (0
    # x out), the program needed less (benchmarks/RESULTS.md, "llama3.1-8b on 4 v5p
    # chips, against MaxText"), but XLA:CPU then corrupts buffers in the interpreted Pallas kernel that
    # adds into them (tests/test_halo.py's windowed ring gets NaNs): left as a
    # constant until that is understood.
    dq = jnp.zeros(q.shape, jnp.float32)
    own = _chunk(k, v, positions, segment_ids)
    if in_order:  # under remat the forward's sends are recomputed beside these
        own, _ = jax.lax.optimization_barrier((own, (out, lse)))
    partial = None
    if size > 1:
        dq, partial = _others_steps(step, dq, _send_all(own, axis_name, in_order), size)
    # The chip's own chunk last: the sum of the others' shares has come home by then and
    # takes this chip's share in place, so no f32 dK/dV pair waits through the steps.
    dq, _, dkv = step(dq, own, partial, send_kv=False)
    return (*(relayout(g.astype(x.dtype), layout, given_layout) for g, x in
              ((dq, q), (dkv[0], k), (dkv[1], v))), None, None)


def _others_steps(step, dq, kv, size):
    """Steps 1 .. c-1 of the backward, the other chips' chunks: dq and the dK/dV sum
    still to send home.

    Step 1 has no sum to receive yet and the last step no K/V to send on; the steps in
    between are all alike, one scan (one kernel call in the program for any c).
    """
    dq, kv, partial = step(dq, kv, None, send_kv=size > 2)
    if size > 3:
        (dq, kv, partial), _ = jax.lax.scan(
            lambda carry, _: (step(*carry, send_kv=True), None), (dq, kv, partial),
            length=size - 3)
    if size > 2:
        dq, _, partial = step(dq, kv, partial, send_kv=False)
    return dq, partial


def _on_the_wire(partial) -> tuple:
    """A dK/dV sum (a pair) as it is sent to the next chip, in DKV_TRANSPORT_DTYPE; ()
    for none."""
    return () if partial is None else tuple(x.astype(DKV_TRANSPORT_DTYPE) for x in partial)


_ring.defvjp(_ring_fwd, _ring_bwd)
