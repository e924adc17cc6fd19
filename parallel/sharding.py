"""Logical axis names -> mesh axes, for parameters and for the input batch."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Parameters are sharded by their model width over fsdp and the context axes (ZeRO-3 style:
# context-parallel chips hold different tokens but need the same weights, so they share
# the weights' storage and gather each layer's weights when it runs) and over tensor by
# heads, MLP width and vocabulary. Activations are split over the batch by data x fsdp and
# over the sequence by the context axes.
LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "embed": ("fsdp", "context", "ulysses"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "batch": ("data", "fsdp"),
    "sequence": ("context", "ulysses"),
}


def _axis_size(mesh: Mesh, mesh_axes) -> int:
    names = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def logical_spec(mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    """PartitionSpec for a tensor; a dimension the mesh axis does not divide stays whole."""
    spec = []
    for name, dim in zip(axes, shape):
        mesh_axes = LOGICAL_TO_MESH[name] if name else None
        if mesh_axes is not None and dim % _axis_size(mesh, mesh_axes) != 0:
            mesh_axes = None
        spec.append(mesh_axes)
    return P(*spec)


def gathered_spec(mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
    """A parameter as a layer computes with it: whole over the ZeRO-3 axes, still split
    over tensor."""
    return logical_spec(mesh, tuple(None if name == "embed" else name for name in axes), shape)


def gathered_weight(mesh: Mesh, w: jax.Array, axes: tuple[str | None, ...],
                    dtype) -> jax.Array:
    """A float32 parameter gathered as gathered_spec says, in the compute `dtype` (half the
    bytes), and handed back in float32: a loop over token chunks then adds its gradient up
    in float32, and that gradient is reduced in float32 to the parameter's own sharding.
    The loop casts it to `dtype` again, so it sees the values a float32 gather would give."""
    whole = NamedSharding(mesh, gathered_spec(mesh, axes, w.shape))

    @jax.custom_vjp
    def gather(w):
        return jax.lax.with_sharding_constraint(w.astype(dtype), whole).astype(w.dtype)

    def forward(w):
        return gather(w), None

    def backward(_, gradient):
        return (jax.lax.with_sharding_constraint(gradient, whole),)

    gather.defvjp(forward, backward)
    return gather(w)


def parameter_shardings(mesh: Mesh, abstract_state: nnx.State) -> dict:
    """NamedShardings (as a pure dict, like the parameters) from each Param's `axes`."""
    def sharding(variable: nnx.Variable) -> NamedSharding:
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        return NamedSharding(mesh, logical_spec(mesh, variable.axes, value.shape))

    shardings = jax.tree.map(sharding, abstract_state,
                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, sequence] inputs: rows over data x fsdp, tokens over context."""
    return NamedSharding(mesh, P(LOGICAL_TO_MESH["batch"], LOGICAL_TO_MESH["sequence"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
