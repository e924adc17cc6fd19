"""Walking a jaxpr together with the programs its equations call (a scan's or cond's
bodies, a pjit's or shard_map's program, a Pallas kernel's body): the one walk the kernels'
structure checks and the tests count equations with."""

from __future__ import annotations

from typing import Iterator

from jax.extend.core import jaxprs_in_params


def subprograms(eqn) -> Iterator:
    """The jaxprs an equation calls."""
    return jaxprs_in_params(eqn.params)


def equations(jaxpr, times: int = 1) -> Iterator[tuple[object, int]]:
    """(equation, how many times it runs per run of `jaxpr`) for every equation of `jaxpr`
    and of the programs it calls, depth first; a scan's body runs `length` times (a cond's
    branches and a kernel's body are counted once)."""
    for eqn in jaxpr.eqns:
        yield eqn, times
        for program in subprograms(eqn):
            yield from equations(program, times * eqn.params.get("length", 1))
