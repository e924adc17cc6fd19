"""The device mesh: four named axes, any of them of size 1."""

from __future__ import annotations

import jax
import numpy as np
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
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except (ValueError, NotImplementedError):
        # jax lays axes along the physical torus only when each is a product of whole
        # torus dimensions (a 32-way axis does not cut a 4x4x4 v5p). Any shape still works
        # with the devices in id order; neighbours on an axis may then be further apart.
        devices = jax.devices() if devices is None else devices
        return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def describe_devices(mesh: Mesh, cpu_devices: int | str) -> str:
    """What a run computes on, e.g. 'devices: 4 x TPU v5p' or 'devices: 8 x cpu (fake,
    runtime.cpu_devices=auto)', so a run on the wrong platform shows in its first line."""
    devices = mesh.devices.flatten()
    fake = devices[0].platform == "cpu" and cpu_devices != 0
    return (f"devices: {len(devices)} x {devices[0].device_kind}"
            + (f" (fake, runtime.cpu_devices={cpu_devices})" if fake else ""))
