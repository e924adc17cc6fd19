"""The device mesh: four named axes, any of them of size 1."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

# The recipe's mesh.context is split in two: 'context' (the ring) x 'ulysses' (the
# all-to-all group, size parallel.ulysses, > 1 only for usp). The sequence is sharded
# over both, ulysses minor, so a ulysses group holds neighbouring chunks.
MESH_AXES = ("data", "fsdp", "context", "ulysses", "tensor")


def build_mesh(axis_sizes: dict[str, int], ulysses: int = 1, devices=None) -> Mesh:
    """A mesh over `devices` (default: all of them) with axes in MESH_AXES order, from the
    recipe's resolved axis sizes (data, fsdp, context, tensor) and the Ulysses degree.

    Auto axis types let XLA propagate shardings through the model; the context-parallel
    strategies take over inside their own shard_map.
    """
    sizes = {**axis_sizes, "context": axis_sizes["context"] // ulysses, "ulysses": ulysses}
    shape = tuple(sizes[name] for name in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
