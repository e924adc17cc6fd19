"""What several test modules build the same way: the planner's pinned tiny model, the
command line of `lctrain run` in a process of its own, closeness of arrays, and the mark
that keeps tests sharing work on one pytest-xdist worker."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import pytest

from lctrain.recipes import Recipe, load_recipe

# The tiny preset pinned (2 layers, width 128, 8 query / 2 KV heads of 16, d_ff 384, vocab
# 128), bfloat16 and the xla kernel, sequences of 4096 tokens: the model whose figures the
# planner's tests count by hand.
TINY_MODEL = ("model.preset=tiny", "model.layers=2", "model.d_model=128", "model.n_heads=8",
              "model.n_kv_heads=2", "model.d_ff=384", "model.vocab=128",
              "model.dtype=bfloat16", "data.seq_len=4096", "attention.impl=xla")


# XLA:CPU's cheap optimization level: the tests' programs run in milliseconds, and LLVM's
# full optimization took most of each one's compile. Numerics stay those of the dtypes.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(fn, *args):
    """jit(fn) compiled for `args` with FAST_COMPILE (XLA:CPU's options; none elsewhere, e.g.
    the kernels compiled by Mosaic on a TPU)."""
    options = FAST_COMPILE if jax.default_backend() == "cpu" else None
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def one_worker(group: str) -> pytest.MarkDecorator:
    """Runs the tests marked with `group` in one pytest-xdist worker (pyproject.toml:
    --dist=loadgroup), so that what they share, a compiled case (a functools.cache) or a
    module fixture's training, is done once, not once per worker."""
    return pytest.mark.xdist_group(group)


def tiny_recipe(settings: Sequence[str], *extra: str) -> Recipe:
    """The tiny recipe with `settings`, then `extra` on top."""
    return load_recipe("tiny", [*settings, *extra])


def lctrain_run(run_dir, *settings: str) -> list[str]:
    """`lctrain run` into `run_dir` in a new process, each of `settings` given with --set."""
    return [sys.executable, "-m", "lctrain.cli.main", "run", "--run-dir", str(run_dir),
            *(arg for setting in settings for arg in ("--set", setting))]


def assert_close(got: Mapping, want: Mapping, atol: float | Mapping[str, float],
                 rtol: float = 0.0) -> None:
    """Each named array of `got` within atol (one for all, or per name) + rtol x |want| of
    `want`'s, element by element. An entry want has at -inf (an empty row's log-sum-exp)
    must be -inf in got too, and got must be finite wherever want is."""
    bounds = atol if isinstance(atol, Mapping) else dict.fromkeys(want, atol)
    beyond = {}
    for name, bound in bounds.items():
        ours, theirs = np.asarray(got[name], np.float64), np.asarray(want[name], np.float64)
        assert np.array_equal(np.isneginf(ours), np.isneginf(theirs)), f"{name}: -inf differ"
        finite = np.isfinite(theirs)
        assert np.all(np.isfinite(ours[finite])), f"{name}: non-finite values"
        error = np.abs(ours[finite] - theirs[finite])
        if np.any(error > bound + rtol * np.abs(theirs[finite])):
            beyond[name] = (float(error.max()), bound)
    assert not beyond, f"error above atol + rtol x |want| (max abs error, atol): {beyond}"
