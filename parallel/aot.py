"""Compile a recipe's train step for a TPU topology without a TPU (libtpu ahead-of-time).

With libtpu installed, `jax.experimental.topologies` describes the chips of e.g.
"v5p:2x2x1" on any machine; jit(...).lower(abstract args).compile() then runs XLA's real
TPU compiler, and the compiled program tells per-chip memory (`memory_analysis()`) and,
in its HLO text, every collective it will run. Nothing is materialised: parameters, state
and batch are ShapeDtypeStructs, so an 8B or 70B recipe compiles on a laptop.

Run with JAX_PLATFORMS=cpu (the topology devices need no TPU backend).
"""

from __future__ import annotations

import dataclasses
import os

from lctrain.parallel.hlo import bytes_by_kind, collective_ops
from lctrain.parallel.native_stderr import shown_only_on_failure

# ------------------------------------------------------------------ devices ----

def topology_devices(name: str, slices: int = 1) -> list:
    """The devices of a TPU topology such as "v5p:2x2x1", "v5e:2x2", "v6e:16x16" (no TPU
    needed, but libtpu is); with `slices` > 1, that many such slices joined over the
    data-center network (each device's slice_index says which)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise RuntimeError(f"compiling for TPU topology '{name}' needs libtpu; install the "
                           f"tpu extra: pip install -e '.[tpu]'") from None
    # libtpu takes a machine-wide lock file when it loads, so that two processes do not
    # drive the same chips; an ahead-of-time compile drives none, so do not wait for (or
    # fail on) another process that holds it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    extra = {"num_slices": slices} if slices > 1 else {}
    try:
        with shown_only_on_failure():  # libtpu loads here, warning that it finds no TPU
            try:
                desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **extra)
            except Exception as err:
                if "chips_per_host_bounds" not in str(err):
                    raise
                desc = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                    chips_per_host_bounds=_one_host(name),
                                                    **extra)
            return list(desc.devices)
    except Exception as err:  # libtpu's message for an unknown name is long and generic
        raise ValueError(f"unknown TPU topology '{name}' (e.g. v4:2x2x1, v5e:1x1, v5e:2x2, "
                         f"v5p:2x2x1, v6e:2x2, tpu7x:2x2x1): {str(err).splitlines()[0]}"
                         ) from err


def _one_host(name: str) -> tuple[int, int, int]:
    """The chips of a topology smaller than libtpu's default host (2x2x1), such as a single
    v5e chip ("v5e:1x1"), as one host of exactly that shape."""
    shape = [int(n) for n in name.split(":")[1].split("x")]
    return tuple(shape + [1] * (3 - len(shape)))


# ------------------------------------------------------------------ compile ----

# -------------------------------------------------------------------- stats ----

@dataclasses.dataclass
class CompiledStats:
    """Per-chip figures of one compiled program."""
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    host_argument_bytes: int
    generated_code_bytes: int
    # Bytes one chip receives per step, by collective kind (parallel/hlo.py): all
    # of them, and those whose jax op_name is inside a shard_map (what the context-parallel
    # strategy sends itself; the rest is parameter gathers, gradient reductions and what
    # XLA's partitioner adds). A collective XLA rewrites can lose its op_name (e.g. a
    # reduce-scatter turned into an all-reduce) and then only counts in the first dict.
    collective_bytes: dict[str, int]
    shard_map_collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # The part of collective_bytes that crosses slices (multi-slice programs: the DCN).
    dcn_collective_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # While loops whose trip count could not be read (counted as running once).
    unknown_trip_counts: int = 0
    # XLA's peak (memory_analysis().peak_memory_in_bytes): what libtpu checks against the
    # chip's HBM. Of a long-context step it is less than the buffers' sum (hbm_bytes), whose
    # temporaries are never all alive together (benchmarks/RESULTS.md, "One v5e chip"); of
    # a small program more, with the runtime's own share. 0 for figures built by hand.
    peak_bytes: int = 0

    @property
    def hbm_bytes(self) -> int:
        """Peak HBM of the step on one chip: arguments + outputs + temporaries - aliased.

        memory_analysis() counts a donated argument that an output reuses (the train state)
        in argument_size AND in output_size, and reports the reused bytes as alias_size, so
        they are subtracted once; temp_size is the peak of everything else XLA allocates
        (activations, gradients, scratch). The program binary (generated_code_bytes, a few
        MB) is left out.
        """
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def memory_stats(compiled) -> CompiledStats:
    """The memory figures of a compiled program alone (no collectives: those need a parse
    of the whole HLO text, which the run's fit check does not)."""
    memory = compiled.memory_analysis()
    return CompiledStats(
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        host_temp_bytes=memory.host_temp_size_in_bytes,
        host_argument_bytes=memory.host_argument_size_in_bytes,
        generated_code_bytes=memory.generated_code_size_in_bytes,
        collective_bytes={},
        peak_bytes=memory.peak_memory_in_bytes)


def compiled_stats(compiled) -> CompiledStats:
    ops, unknown = collective_ops(compiled.as_text())
    return dataclasses.replace(
        memory_stats(compiled),
        collective_bytes=bytes_by_kind(ops),
        shard_map_collective_bytes=bytes_by_kind(ops, "shard_map"),
        dcn_collective_bytes=bytes_by_kind([op for op in ops if op.dcn]),
        unknown_trip_counts=unknown)
