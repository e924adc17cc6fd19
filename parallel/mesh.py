"""The device mesh: four named axes, any of them of size 1."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "context", "tensor")


def build_mesh(axis_sizes: dict[str, int], devices=None) -> Mesh:
    """A mesh over `devices` (default: all of them) with axes in MESH_AXES order.

    Auto axis types let XLA propagate shardings through the model; the context-parallel
    strategies take over inside their own shard_map.
    """
    shape = tuple(axis_sizes[name] for name in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
