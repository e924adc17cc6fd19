"""How the model's layers create and read their parameters (trainer/model/transformer.py and
trainer/model/gdn_layer.py share it)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...],
          fan_in: int) -> nnx.Param:
    """A matrix initialised normal with std 1/sqrt(fan_in), with its logical `axes`."""
    init = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(init, axes=axes)


def weight(param: nnx.Param, dtype) -> jax.Array:
    return param[...].astype(dtype)
