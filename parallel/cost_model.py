"""What a context-parallel strategy tells the planner about its own costs.

Each strategy class (`ContextStrategy` subclasses, parallel/strategy.py) answers, from
the per-device dimensions below: its attention working set in one layer's backward, what
its kernel keeps when nothing is recomputed, the bytes its own collectives deliver per
micro-batch, and (ring-like strategies) how a ring step's send compares with its work.
The planner (parallel/planner/) adds the terms every strategy shares: states, weights,
activations, the loss, the MLP.

No jax here: these are formulas over integers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

F32, INT32 = 4, 4
# Positions and segment ids: one int32 each per token.
TOKEN_IDS = 2 * INT32

# source -> (collective kind, bytes one device receives per micro-batch)
Traffic = dict[str, tuple[str, float]]
# The traffic source of a ring's sends: the one part of a strategy's traffic that can hide
# behind its work (how much of it does: RingTiming); the rest attention waits for.
RING_SENDS = "strategy_ring"


@dataclasses.dataclass(frozen=True)
class Dims:
    """One device's share of the step, for one strategy (planner.shapes.dims builds it)."""
    b: int          # rows per device per micro-batch
    rows: int       # rows per device per step (all micro-batches)
    accum: int
    s: int          # sequence length
    c: int          # context degree (ring x ulysses)
    u: int          # Ulysses degree (ulysses: c; usp: parallel.ulysses; else 1)
    r: int          # ring degree (ring: c; usp: c/u; else 1)
    t: int
    z: int          # ZeRO-3 group (fsdp x context)
    g: int          # gradient group (data x fsdp x context)
    p: int          # compute dtype bytes
    e: int
    h: int          # query heads per tensor shard
    kv: int         # KV heads per tensor shard (at least 1)
    d: int
    f: int          # d_ff per tensor shard
    v: int          # vocabulary per tensor shard
    layers: int
    remat: str      # remat.policy
    context_kept: bool  # the policy keeps attention's results (named `context`)
    window: int | None = None  # sliding-window layers' window (None: global attention)
    conv_kernel: int = 0    # linear layers' causal conv width (0: no conv)
    # The layer scan picks each layer's kind with a switch (ModelConfig.switches_layer_kinds):
    # inside it XLA hoists nothing out of the layer loop, e.g. a strategy's sends of the
    # positions and segment ids, which do not depend on the layer.
    kinds_switched: bool = False

    @property
    def s_l(self) -> int:
        return self.s // self.c

    @property
    def step_tokens(self) -> int:
        """Tokens per device per step (all micro-batches)."""
        return self.rows * self.s_l

    @property
    def attention_passes(self) -> int:
        """Forward runs of attention per step: save_all keeps the kernel's residuals; every
        other policy recomputes the attention forward in the backward."""
        return 1 if self.remat == "save_all" else 2

    @property
    def ring_passes(self) -> int:
        """Forward runs of a ring per step: its custom VJP names out and logsumexp
        `context`, so a policy that keeps them never runs the ring (and its sends) again;
        gathers and all-to-alls ahead of a kernel still run again for its q, k, v."""
        return 1 if self.context_kept else self.attention_passes

    @property
    def kv_repeated(self) -> int:
        """KV heads per tensor shard once Ulysses repeats them up to a multiple of its
        degree (parallel/ulysses.repeat_kv_heads_for)."""
        return math.lcm(self.kv, self.u) if self.u > 1 and self.kv % self.u else self.kv


class AttentionFootprint(NamedTuple):
    """The strategy's attention working set in one layer's backward (bytes, before
    calibration), and the kernel call it makes on one device: q and kv tokens, query and
    KV heads (the planner sizes the kernel's own scratch from them)."""
    working_set: float
    q_tokens: int
    kv_tokens: int
    heads: int
    kv_heads: int


class RingTiming(NamedTuple):
    """A ring's balance of work and sends: one ring step's attention time over its K/V
    send time (>= 1: the send hides behind the work), and the memory-bound merges the ring
    adds per step, in seconds."""
    work_over_send: float
    merge_seconds: float


class NotOnThisMesh(Exception):
    """The strategy cannot run on this mesh; the message says why."""
