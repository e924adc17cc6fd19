"""Compile for a real TPU topology on a CPU-only machine (libtpu ahead-of-time) and read
the compiler's memory figures: memory tests without a TPU.

Skips the calling test when libtpu is not installed (`pip install -e ".[tpu]"`), so the
fast suite runs without it. libtpu's warnings about the missing TPU are kept off the
terminal (parallel/native_stderr.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import jax
import pytest
from jax.sharding import Mesh

from lctrain.parallel.aot import topology_devices
from lctrain.parallel.mesh import build_mesh

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="TPU AOT compiles need libtpu (the tpu extra)")


def tpu_mesh(topology: str, axis_sizes: dict[str, int]) -> Mesh:
    """The project's mesh (parallel/mesh.py) over the chips of e.g. topology "v5p:2x2x1".

    axis_sizes has the recipe's mesh axes (data, fsdp, context, tensor); their product must
    be the topology's chip count.
    """
    pytest.importorskip("libtpu", reason="TPU AOT compiles need libtpu (the tpu extra)")
    return build_mesh(axis_sizes, devices=topology_devices(topology))


def compiled_memory(fn: Callable, in_shardings: Any, out_shardings: Any,
                    *abstract_args: jax.ShapeDtypeStruct) -> Any:
    """Compiles jit(fn) for the shardings' devices; returns its memory_analysis() (per chip:
    temp_size_in_bytes, argument_size_in_bytes, output_size_in_bytes, ...)."""
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    return jitted.lower(*abstract_args).compile().memory_analysis()
