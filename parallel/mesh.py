"""The device mesh: five named axes, any of them of size 1, over one slice or several.

Past one TPU slice, slices talk over the data-center network (DCN), an order of magnitude
slower than the chips' own interconnect (ICI). A multi-slice mesh (MaxText's hybrid mesh)
spreads only the data and fsdp axes over slices (mesh.dcn_data, mesh.dcn_fsdp): each
axis's index is (slice part) x (in-slice part), slice part major, so the devices of one
slice share every index of the slice part and everything else stays inside a slice.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from lctrain.recipes.schema import RecipeError

# The recipe's mesh.context is split in two: 'context' (the ring) x 'ulysses' (the
# all-to-all group, size parallel.ulysses, > 1 only for usp). The sequence is sharded
# over both, ulysses minor, so a ulysses group holds neighbouring chunks.
MESH_AXES = ("data", "fsdp", "context", "ulysses", "tensor")


def build_mesh(axis_sizes: dict[str, int], ulysses: int = 1, devices=None,
               dcn: dict[str, int] | None = None) -> Mesh:
    """A mesh over `devices` (default: all of them) with axes in MESH_AXES order, from the
    recipe's resolved axis sizes (data, fsdp, context, tensor: total degrees), the Ulysses
    degree and the slices each axis spans (`dcn`, mesh.dcn_data / mesh.dcn_fsdp as
    {"data": 2}; default: all the slices the devices report, over data).

    Auto axis types let XLA propagate shardings through the model; the context-parallel
    strategies take over inside their own shard_map.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = {**axis_sizes, "context": axis_sizes["context"] // ulysses, "ulysses": ulysses}
    shape = tuple(sizes[name] for name in MESH_AXES)
    found = slice_count(devices)
    dcn = {"data": found or 1} if dcn is None else dcn
    dcn_shape = tuple(dcn.get(name, 1) for name in MESH_AXES)
    _check_slices(shape, dcn_shape, found)
    groups = slice_groups(devices, math.prod(dcn_shape))
    if len(groups) == 1:
        grid = _in_slice_grid(shape, devices)
    else:
        ici_shape = tuple(size // d for size, d in zip(shape, dcn_shape))
        blocks = np.empty(dcn_shape, dtype=object)
        for index, group in enumerate(groups):
            blocks.flat[index] = _in_slice_grid(ici_shape, group)
        grid = np.block(blocks.tolist())
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _check_slices(shape: tuple[int, ...], dcn_shape: tuple[int, ...], found: int | None
                  ) -> None:
    """Each axis's slice part divides it, and the slices are those the devices form (the
    recipe loader checks the same; this catches callers that pass other devices)."""
    for name, size, degree in zip(MESH_AXES, shape, dcn_shape):
        if size % degree:
            raise RecipeError(f"recipe key 'mesh.dcn_{name}' = {degree}: must divide "
                              f"mesh.{name} ({size}), the axis's total degree")
    if found not in (None, math.prod(dcn_shape)):
        raise RecipeError(f"recipe key 'mesh.dcn_data' = {dcn_shape[0]}: the devices form "
                          f"{found} slice(s) but mesh.dcn_data x mesh.dcn_fsdp = "
                          f"{math.prod(dcn_shape)}; make the product {found}")


def slice_count(devices) -> int | None:
    """How many slices the devices form (their distinct slice_index); None for devices
    that carry none (CPU)."""
    if not hasattr(devices[0], "slice_index"):
        return None
    return len({device.slice_index for device in devices})


def slice_groups(devices, count: int) -> list[list]:
    """The devices of each slice, in slice order: by slice_index where the devices carry
    one, else `count` equal groups of consecutive ids (fake slices, so that CPU tests can
    exercise a multi-slice mesh)."""
    if slice_count(devices) is None:
        ordered = sorted(devices, key=lambda device: device.id)
        size = len(ordered) // count
        return [ordered[i * size:(i + 1) * size] for i in range(count)]
    by_slice: dict[int, list] = {}
    for device in devices:
        by_slice.setdefault(device.slice_index, []).append(device)
    return [by_slice[index] for index in sorted(by_slice)]


def _in_slice_grid(shape: tuple[int, ...], devices) -> np.ndarray:
    """`devices` (one slice's) arranged as `shape`, neighbours on an axis close on the
    torus where jax can manage it."""
    try:
        return jax.make_mesh(shape, MESH_AXES, devices=devices).devices
    except (ValueError, NotImplementedError):
        # jax lays axes along the physical torus only when each is a product of whole
        # torus dimensions (a 32-way axis does not cut a 4x4x4 v5p). Any shape still works
        # with the devices in id order; neighbours on an axis may then be further apart.
        return np.asarray(devices).reshape(shape)


def describe_devices(mesh: Mesh, cpu_devices: int | str) -> str:
    """What a run computes on, e.g. 'devices: 4 x TPU v5p' or 'devices: 8 x cpu (fake,
    runtime.cpu_devices=auto)', so a run on the wrong platform shows in its first line."""
    devices = mesh.devices.flatten()
    fake = devices[0].platform == "cpu" and cpu_devices != 0
    return (f"devices: {len(devices)} x {devices[0].device_kind}"
            + (f" (fake, runtime.cpu_devices={cpu_devices})" if fake else ""))
