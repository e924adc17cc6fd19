"""The one interface every context-parallel strategy implements.

The model calls `strategy.attend(q, k, v, positions, segment_ids, window=...)` with
global-shape,
mesh-sharded arrays ([batch, seq, heads, head_dim]). `attend` enters a shard_map over the
whole mesh (kernels such as Mosaic's must run inside one) and hands each device its
shard: a strategy only writes `local_attention`, deciding how the device's chunk of the
sequence meets the rest of it, and calls the kernel from `lctrain.kernels` for the work.
Its cost model (classmethods below, formulas over parallel/cost_model.Dims) tells the
planner what that costs per device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lctrain import kernels
from lctrain.kernels import pallas, splash, tiles, triton
from lctrain.parallel.chips import chip_for_device_kind
from lctrain.parallel.cost_model import (F32, AttentionFootprint, Dims, NotOnThisMesh, RingTiming,
                                         Traffic)
from lctrain.parallel.sharding import LOGICAL_TO_MESH, gathered_weight
from lctrain.recipes import stored_chunks
from lctrain.recipes.schema import AttentionConfig, Recipe, RecipeError

if TYPE_CHECKING:
    from lctrain.parallel.chips import Chip

CONTEXT_AXIS = "context"
HEADS_SPEC = P(LOGICAL_TO_MESH["batch"], LOGICAL_TO_MESH["sequence"], "tensor", None)
TOKENS_SPEC = P(LOGICAL_TO_MESH["batch"], LOGICAL_TO_MESH["sequence"])


class ContextStrategy:
    name: ClassVar[str]
    # The planner's tie-break: of the plans whose step times are near-equal, the lowest
    # simplicity (the simplest strategy to run and debug) is recommended.
    simplicity: ClassVar[int]
    # parallel.ulysses sets this strategy's Ulysses degree, so a plan of it is one degree
    # (shown as name(u=degree)).
    takes_ulysses_degree: ClassVar[bool] = False

    def __init__(self, recipe: Recipe, mesh: Mesh):
        self.mesh = mesh
        self.sequence_shards = mesh.shape["context"] * mesh.shape["ulysses"]
        # The kernel is chosen for the mesh's devices, which are TPUs in an ahead-of-time
        # compile for a TPU topology even though the host is a CPU.
        device = mesh.devices.flat[0]
        a = attention_on(recipe, chip_generation(device), self.sequence_shards)
        self.kernel_options = dict(impl=a.impl, block_q=a.block_q, block_kv=a.block_kv,
                                   platform=device.platform,
                                   run_tokens=stored_chunk_tokens(recipe, self.sequence_shards))
        self.load_balance = recipe.parallel.load_balance and self.sequence_shards > 1

    @classmethod
    def check(cls, recipe: Recipe, axis_sizes: dict[str, int], platform: str = "tpu") -> None:
        """Raises RecipeError for combinations this strategy cannot run on `platform`'s
        devices (before any compile)."""
        check_kernel_layout(recipe, axis_sizes, cls.kernel_lengths(recipe, axis_sizes),
                            platform)

    @classmethod
    def kernel_lengths(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> tuple[int, int]:
        """(queries, keys) of one kernel call on a device: its chunk against the sequence."""
        return recipe.data.seq_len // axis_sizes["context"], recipe.data.seq_len

    # ------------------------------------------------ cost model (the planner's) ----

    @classmethod
    def planned_ulysses_degree(cls, recipe: Recipe, axis_sizes: dict[str, int]) -> int:
        """The Ulysses degree the planner weighs this strategy at on this mesh (1 where it
        has none); raises NotOnThisMesh where the strategy cannot run. Splitting the
        sequence needs a context axis."""
        if axis_sizes["context"] == 1:
            raise NotOnThisMesh("mesh.context is 1")
        return 1

    @classmethod
    def degrees(cls, context: int, ulysses: int) -> tuple[int, int]:
        """(Ulysses degree, ring degree) at mesh.context `context` and parallel.ulysses
        `ulysses`: neither by default."""
        return 1, 1

    @classmethod
    def attention_footprint(cls, dm: Dims) -> AttentionFootprint:
        """The attention's working set in one layer's backward, and its kernel call."""
        raise NotImplementedError

    @classmethod
    def kernel_residuals(cls, dm: Dims) -> float:
        """remat.policy=save_all: what the attention kernel keeps per layer (its custom VJP
        residuals); by default for the local queries and the local K, V."""
        return query_residuals(dm) + 2 * dm.b * dm.s_l * dm.kv * dm.d * dm.p

    @classmethod
    def traffic(cls, dm: Dims) -> Traffic:
        """Bytes the strategy's own collectives deliver to one device per micro-batch, by
        source (named strategy_*). All of it is on the critical path (attention waits
        for it) but for a ring's sends (source RING_SENDS), which ring_timing weighs."""
        raise NotImplementedError

    @classmethod
    def ring_timing(cls, dm: Dims, chip: Chip) -> RingTiming | None:
        """Strategies with a ring: how its sends and merges weigh against its work."""
        return None

    def sequence_order(self, seq_len: int) -> np.ndarray | None:
        """Token order the batch is stored in on device; None keeps the natural order.

        With causal attention the last context rank would do most of the work; splitting
        the sequence into 2*context chunks and giving rank i chunks i and 2*context-1-i
        evens it out. Positions and segment ids travel with the tokens, so masks and RoPE
        stay exact and the loss is unchanged.
        """
        if not self.load_balance:
            return None
        return load_balanced_order(seq_len, self.sequence_shards)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
               segment_ids: jax.Array, *, window: int | None = None) -> jax.Array:
        """Causal attention of the stored batch; `positions` (RoPE's, restarting in every
        document) only give the shape: the kernels mask by each token's index in the
        sequence, which orders the tokens of a document alike (segment ids keep documents
        apart) and runs contiguously through the chunks of the stored order, so kernels
        can classify whole blocks (splash needs that). `window`: sliding-window attention
        (kernels/masks.py; index differences within a document are position
        differences, so the window is the same); None: global."""
        per_device = jax.shard_map(
            functools.partial(self.local_attention, window=window), mesh=self.mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, TOKENS_SPEC, TOKENS_SPEC),
            out_specs=HEADS_SPEC, check_vma=False)
        return per_device(q, k, v, self.sequence_indices(positions.shape), segment_ids)

    def sequence_indices(self, shape: tuple[int, int]) -> jax.Array:
        """int32 [b, s]: the index in the original sequence of every stored token, computed
        from an iota (no s-sized constant in the program)."""
        batch, seq_len = shape
        index = (load_balanced_order(seq_len, self.sequence_shards, xp=jnp) if self.load_balance
                 else jnp.arange(seq_len, dtype=jnp.int32))
        return jnp.broadcast_to(index.astype(jnp.int32), shape)

    def split_tokens(self, x: jax.Array) -> jax.Array:
        """Constrains a [batch, seq, ...] activation to rows over data x fsdp and tokens
        over the context axes, the layout every strategy expects."""
        spec = P(LOGICAL_TO_MESH["batch"], LOGICAL_TO_MESH["sequence"], *[None] * (x.ndim - 2))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def gather_weight(self, w: jax.Array, axes: tuple[str, ...], dtype) -> jax.Array:
        """A parameter (logical `axes`) whole on every device but for tensor parallelism,
        gathered in `dtype` where this is called, e.g. once before a loop that uses it
        (parallel/sharding.gathered_weight)."""
        return gathered_weight(self.mesh, w, axes, dtype)

    def local_attention(self, q, k, v, positions, segment_ids, window=None):
        """One device's work: its [b, s/context, heads/tensor, d] chunk of q, k, v, with
        sliding `window` (None: global)."""
        raise NotImplementedError

    def kernel(self, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
               return_lse=False, layout=kernels.TOKENS_MAJOR, window=None):
        return kernels.attention(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                 causal=True, return_lse=return_lse, layout=layout,
                                 window=window, **self.kernel_options)


def query_residuals(dm: Dims) -> float:
    """What an attention kernel keeps of its local queries for the backward: q, out (compute
    dtype) and the f32 logsumexp."""
    tokens = dm.b * dm.s_l
    return tokens * (2 * dm.h * dm.d * dm.p + dm.h * F32)


def stored_chunk_tokens(recipe: Recipe, context: int) -> int:
    """Length of the contiguous runs of the original sequence that the stored order is
    made of (recipes.stored_chunks of them)."""
    return recipe.data.seq_len // stored_chunks(recipe, context)


def chip_generation(device) -> str | None:
    """'v5e' for a device of a v5e chip (jax's device or an AOT topology's); None for CPU."""
    chip = chip_for_device_kind(device.device_kind)
    return chip.name if chip else None


def attention_on(recipe: Recipe, chip: str | None, sequence_shards: int) -> AttentionConfig:
    """The recipe's attention with what it leaves to lctrain filled in for `chip`: impl
    auto becomes the kernel measured fastest there (kernels/tiles.py), unset blocks that
    kernel's measured blocks, else kernels.tiles.DEFAULT_BLOCK."""
    a = recipe.attention
    best = tiles.measured(chip, recipe.data.seq_len // sequence_shards)
    impl = best.impl if best and a.impl == "auto" else a.impl
    blocks = ((best.block_q, best.block_kv) if best and best.impl == impl
              else (tiles.DEFAULT_BLOCK, tiles.DEFAULT_BLOCK))
    return dataclasses.replace(a, impl=impl, block_q=a.block_q or blocks[0],
                               block_kv=a.block_kv or blocks[1])


def check_kernel_layout(recipe: Recipe, axis_sizes: dict[str, int],
                        kernel_lengths: tuple[int, int], platform: str = "tpu") -> None:
    """RecipeError when the attention kernel cannot run a kernel call of `kernel_lengths`
    (queries, keys) on the stored layout: splash's chunks or block map, or the Pallas
    kernel's TPU tiles."""
    if recipe.attention.impl == "splash":
        _check_splash_layout(recipe, axis_sizes, kernel_lengths)
    if recipe.attention.impl == "triton":
        _check_triton_tiles(recipe, kernel_lengths, platform)
    _check_pallas_tiles(recipe, axis_sizes, kernel_lengths, platform)


def _check_triton_tiles(recipe: Recipe, kernel_lengths: tuple[int, int], platform: str) -> None:
    """The GPU kernel runs on GPUs only, and its matmuls need tiles of at least
    kernels.triton.MIN_TILE tokens (interpret mode on CPU takes any length)."""
    key = "recipe key 'attention.impl' = 'triton'"
    if platform == "tpu":
        raise RecipeError(f"{key}: {kernels.GPU_ONLY}")
    short = [n for n in kernel_lengths if n % triton.MIN_TILE]
    if platform == "gpu" and short:
        raise RecipeError(
            f"{key}: a kernel call of {short[0]} tokens (data.seq_len {recipe.data.seq_len}) "
            f"is not a multiple of the {triton.MIN_TILE}-token tiles its matmuls need; make "
            f"data.seq_len a multiple of "
            f"{triton.MIN_TILE * recipe.data.seq_len // min(kernel_lengths)}")


def _check_pallas_tiles(recipe: Recipe, axis_sizes: dict[str, int],
                        kernel_lengths: tuple[int, int], platform: str) -> None:
    """Mosaic tiles a call in blocks of a multiple of 128 tokens, or one block of the
    whole length (pallas.block_size), so a call of e.g. 2000 tokens fails at trace time;
    interpret mode (CPU) takes any length, and on GPU the xla kernel runs."""
    context = axis_sizes["context"]
    a = attention_on(recipe, None, context)
    if platform != "tpu" or kernels.impl_for_call(
            a.impl, platform, *kernel_lengths, a.block_q, a.block_kv,
            stored_chunk_tokens(recipe, context)) != "pallas":
        return
    try:
        for length, block in zip(kernel_lengths, (a.block_q, a.block_kv)):
            pallas.block_size(length, block, interpret=False)
    except ValueError as err:
        multiple = math.lcm(128 * recipe.data.seq_len // min(kernel_lengths),
                            stored_chunks(recipe, context))
        raise RecipeError(
            f"recipe key 'attention.impl' = '{a.impl}': each kernel call on TPU takes "
            f"{kernel_lengths[0]} queries x {kernel_lengths[1]} keys (data.seq_len "
            f"{recipe.data.seq_len}, mesh.context {context}), and {err}; make data.seq_len a "
            f"multiple of {multiple}, or use attention.impl=xla") from None


def _check_splash_layout(recipe: Recipe, axis_sizes: dict[str, int],
                         kernel_lengths: tuple[int, int]) -> None:
    """Splash needs every block inside one stored chunk, and its block map in SMEM."""
    context = axis_sizes["context"]
    chunk = stored_chunk_tokens(recipe, context)
    if not splash.fits_chunks(chunk):
        chunks = stored_chunks(recipe, context)
        raise RecipeError(
            f"recipe key 'attention.impl' = 'splash': the stored sequence is made of chunks "
            f"of {chunk} tokens (data.seq_len {recipe.data.seq_len} / {chunks}: "
            f"mesh.context {context}" + (", x2 for parallel.load_balance" if chunks > context
                                         else "") + "), and splash needs multiples of 128; "
            "change data.seq_len, or use attention.impl=pallas or auto")
    try:
        a = attention_on(recipe, None, context)
        splash.block_sizes(*kernel_lengths, a.block_q, a.block_kv, chunk)
    except ValueError as err:
        raise RecipeError(f"recipe key 'attention.impl' = 'splash': {err}") from err


def load_balanced_order(seq_len: int, context: int, xp=np):
    """Original index of each stored token: rank i stores chunks i and 2*context-1-i of
    2*context. `xp` is numpy (the data pipeline) or jax.numpy (inside a program)."""
    chunk = seq_len // (2 * context)
    stored = xp.arange(seq_len)
    rank, offset = stored // (2 * chunk), stored % (2 * chunk)
    chunk_index = xp.where(offset < chunk, rank, 2 * context - 1 - rank)
    return chunk_index * chunk + offset % chunk
