"""How the decoder's stacked layers are applied: `lax.scan` over the layers (one step per
layer, the step picking its layer's kind with a switch where there are several, from one
parameter stack or two), or over groups of layers rematerialized whole
(remat.layers_per_checkpoint). Each names the layer input it saves
`decoder_layer_input`, where a remat policy can keep or offload it."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lctrain.kernels.scopes import layer_share_scope


def layer_input(x: jax.Array, pieces: int = 1) -> jax.Array:
    """x named decoder_layer_input, what a remat policy saves or offloads, in `pieces`
    slices of its features: libtpu aborts offloading a piece of 4 GiB
    (remat.OFFLOAD_PIECE_LIMIT), and a slice of d_model keeps each chip's tokens."""
    if pieces == 1:
        return checkpoint_name(x, "decoder_layer_input")
    return jnp.concatenate([checkpoint_name(part, "decoder_layer_input")
                            for part in jnp.split(x, pieces, axis=-1)], axis=-1)


def named_input(apply: Callable, name_input: Callable = layer_input) -> Callable:
    return lambda x, layer_state: apply(name_input(x), layer_state)


def _scoped(fn: Callable, scope: str) -> Callable:
    def scoped(*args):
        with jax.named_scope(scope):
            return fn(*args)
    return scoped


def scan_layers_by_kind(x: jax.Array, stacks: Mapping[str, nnx.State], kinds: list[str],
                        fns: Mapping[str, Callable], stack_of: Callable[[str], str],
                        remat: Callable[[Callable], Callable],
                        name_input: Callable = layer_input) -> jax.Array:
    """Applies the layers, layer i being fns[kinds[i]](x, its state) -> x, one scan step
    per layer; with several kinds the step picks its layer's with lax.switch. A kind's
    layers are the stack stacks[stack_of(kind)] (leading 'layers' axis), in order.

    Each kind's layer is rematerialized inside its switch branch as well as outside: the
    backward then recomputes a layer inside its own branch, and no residual of one kind
    waits beside the other's (the switch alone, or around attention only, holds both:
    docs/layer-patterns.md). The layer input is named outside the switch, where
    a remat policy can offload it. One stack is scanned over; several (attention and
    linear layers' parameters differ) are read whole by every step, each branch slicing
    its layer from its own stack."""
    names = list(fns)
    if len(names) == 1:
        layer = remat(named_input(fns[names[0]], name_input))
        return jax.lax.scan(lambda x, state: (layer(x, state), None), x,
                            stacks[stack_of(names[0])])[0]

    def branch(name):
        apply = remat(fns[name])
        return lambda x, states: apply(x, states[stack_of(name)])

    if len(stacks) == 1:  # the scan hands each step its layer: step i, layer i
        whole, per_step = None, dict(stacks)

        def layer_states(_, states):
            return states
    else:
        # Every step slices a layer from each stack (its own kind's, and a neighbour from
        # the others) before the switch: sliced inside a branch, each branch's gradient
        # would be the size of the whole stacks (benchmarks/RESULTS.md, "Linear and
        # global layers at the cost of their parts").
        whole, per_step = dict(stacks), _places_in_stacks([stack_of(kind) for kind in kinds])

        def layer_states(whole, places):
            return {name: _layer(stack, places[name]) for name, stack in whole.items()}

    branches = [_scoped(branch(name), layer_share_scope(name, kinds.count(name), len(kinds)))
                for name in names]
    layer = remat(lambda x, whole, step, index: jax.lax.switch(
        index, branches, name_input(x), layer_states(whole, step)))
    index = jnp.asarray([names.index(kind) for kind in kinds], jnp.int32)
    return jax.lax.scan(lambda x, xs: (layer(x, whole, *xs), None), x, (per_step, index))[0]


def scan_layer_groups(x: jax.Array, stacked: nnx.State, fn: Callable,
                      remat: Callable[..., Callable], size: int,
                      name_input: Callable = layer_input) -> jax.Array:
    """The stacked layers, fn(x, state) -> x each, scanned `size` at a time, each group
    rematerialized as a whole around its layers' own remat: the scan saves the input of
    every group's first layer only (named decoder_layer_input, so a policy can offload
    it), and the backward recomputes the group's forward to reach its other layers'
    inputs. Layers after the last whole group follow one by one.

    `remat(fn, prevent_cse=...)` wraps a function in the policy's checkpoint. The group's
    layers are unrolled, so their own checkpoints prevent CSE: XLA would otherwise merge
    the group's recomputed forward with each layer's own recomputation in its backward and
    keep that layer's intermediates through the next one's (benchmarks/RESULTS.md, "One
    layer input in two, recomputed apart")."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    groups = layers // size
    layer = remat(fn, prevent_cse=True)

    def group(x, states):
        for i in range(size):
            x = layer(x, _layer(states, i))
        return x

    whole, alone = (remat(named_input(apply, name_input)) for apply in (group, fn))
    x = jax.lax.scan(lambda x, states: (whole(x, states), None), x,
                     _repeats(stacked, groups, size))[0]
    for i in range(groups * size, layers):
        x = alone(x, _layer(stacked, i))
    return x


def _repeats(stacked: nnx.State, repeats: int, per_repeat: int) -> nnx.State:
    """The stack's first repeats * per_repeat layers, as [repeats, per_repeat, ...]
    ([repeats, ...] for one layer a repeat)."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    scanned = stacked if repeats * per_repeat == layers else jax.tree.map(
        lambda p: p[:repeats * per_repeat], stacked)
    if per_repeat == 1:
        return scanned
    return jax.tree.map(lambda p: p.reshape(repeats, per_repeat, *p.shape[1:]), scanned)


def _places_in_stacks(stack_names: list[str]) -> dict[str, jax.Array]:
    """Per stack, the layer each step reads from it: how many of its layers come before the
    step (the step's own layer where it is in that stack), at most its last."""
    places = {name: [] for name in dict.fromkeys(stack_names)}
    for step in range(len(stack_names)):
        for stack, taken in places.items():
            taken.append(min(stack_names[:step].count(stack), stack_names.count(stack) - 1))
    return {name: jnp.asarray(taken, jnp.int32) for name, taken in places.items()}


def _layer(states: nnx.State, i: int) -> nnx.State:
    return jax.tree.map(lambda p: p[i], states)
