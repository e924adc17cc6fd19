"""Accelerator facts the planner and the MFU figure need.

Sources: Google Cloud TPU system-architecture pages for each generation (HBM, bf16
peak, ICI bandwidth), "How to Scale Your Model" (the JAX scaling book, TPU chapter) for
per-link ICI figures, and NVIDIA's H100/H200 data sheets (SXM, dense bf16, NVLink 4).
HBM is the capacity XLA can allocate (v5p: 95.74 GiB, as XLA's TPU compiler prints it in
its out-of-memory messages, "Used 97.24G of 95.74G hbm", in binary units: tsl's
HumanReadableNumBytes, 1G = 2**30; benchmarks/data/planner_grid.jsonl stores that capacity
as 102,800,042,230 bytes); `hbm_bytes_per_s` its
bandwidth (the same pages: v4 1228, v5e 819, v5p 2765, v6e 1640, Ironwood 7380 GB/s).
`link_bytes_per_s` is the one-way bandwidth of one chip-to-neighbour link (the ring's
unit); `links` is how many such links a chip drives at once in a torus (or NVLink ports to
the switch, counted as one aggregate link for GPUs). A TPU7x (Ironwood) chip holds two
TensorCores that JAX shows as two devices, each with half the chip.

`dcn_bytes_per_s` is a chip's share of its host's data-center network (DCN), the only
path between slices; Google Cloud's TPU pages give it per chip: v5p 50 Gb/s
(https://cloud.google.com/tpu/docs/v5p, "Data center network (DCN) bandwidth per chip"),
v6e and TPU7x 100 Gb/s (https://cloud.google.com/tpu/docs/tpu7x, the table comparing v5p,
v6e and TPU7x), v5e 2 x 100 Gb/s NICs per 8-chip host = 25 Gb/s
(https://cloud.google.com/tpu/docs/v5e, "Per-host NIC configuration"). None where no
figure is published here (v4; GPUs have no slices): multi-slice plans refuse those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 10**9         # the unit every memory figure is shown in (the plan, the run, errors)
GIB = 2**30        # XLA's "G" (its messages and HBM capacities)
GBIT = 10**9 / 8   # bytes per second in one Gb/s


def gigabytes(nbytes: float) -> str:
    """A memory figure as users read it everywhere: decimal GB (MB below 0.1 GB)."""
    return f"{gb_figure(nbytes)} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:,.1f} MB"


def gb_figure(nbytes: float) -> str:
    """The number alone, in decimal GB: a table's cell under a GB heading."""
    return f"{nbytes / GB:,.2f}"


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: float
    peak_bf16_flops: float
    link_bytes_per_s: float
    links: int
    host_bytes: float          # host memory per chip (VM memory / chips per host)
    device_kinds: tuple[str, ...]  # substrings of jax's device_kind naming this chip
    hbm_bytes_per_s: float = 0.0   # HBM bandwidth (the planner's memory-bound work)
    devices_per_chip: int = 1      # JAX devices one chip appears as
    dcn_bytes_per_s: float | None = None  # the chip's share of the host's DCN bandwidth
    platform: str = "tpu"          # jax's platform name for this chip's devices

    def per_device(self) -> Chip:
        """The share of one JAX device: the chip itself unless it shows as several."""
        n = self.devices_per_chip
        return dataclasses.replace(
            self, hbm_bytes=self.hbm_bytes / n, peak_bf16_flops=self.peak_bf16_flops / n,
            link_bytes_per_s=self.link_bytes_per_s / n, host_bytes=self.host_bytes / n,
            hbm_bytes_per_s=self.hbm_bytes_per_s / n, devices_per_chip=1,
            dcn_bytes_per_s=self.dcn_bytes_per_s and self.dcn_bytes_per_s / n)


# HBM is what the runtime hands a program, as libtpu reports it (for a v5e, its 16 GiB less
# the runtime's own).
CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    Chip("v4", 32 * GB, 275e12, 45e9, 6, 100 * GB, ("TPU v4",), 1228 * GB),
    Chip("v5e", 15.75 * GIB, 197e12, 45e9, 4, 48 * GB, ("TPU v5 lite", "TPU v5e"), 819 * GB,
         dcn_bytes_per_s=25 * GBIT),
    Chip("v5p", 95.74 * GIB, 459e12, 90e9, 6, 112 * GB, ("TPU v5p", "TPU v5"), 2765 * GB,
         dcn_bytes_per_s=50 * GBIT),
    Chip("v6e", 32 * GB, 918e12, 90e9, 4, 180 * GB, ("TPU v6 lite", "TPU v6e"), 1640 * GB,
         dcn_bytes_per_s=100 * GBIT),
    Chip("tpu7x", 192 * GB, 2307e12, 150e9, 6, 180 * GB, ("TPU7x", "TPU 7x"), 7380 * GB, 2,
         dcn_bytes_per_s=100 * GBIT),
    Chip("h100", 80 * GB, 989e12, 450e9, 1, 250 * GB, ("H100",), 3350 * GB,
         platform="gpu"),
    Chip("h200", 141 * GB, 989e12, 450e9, 1, 250 * GB, ("H200",), 4800 * GB,
         platform="gpu"),
)}


# What a TPU program needs beside the buffers XLA's TPU compiler checks against HBM: its own
# code, the batches prefetched beside it and the runtime's own. On a v5e a step the
# compiler accepted failed to load its code, a few MB short (benchmarks/RESULTS.md, "One
# v5e chip, 2026-12-07"), so the compiler is given the HBM
# less this (compile_options_for): a program it accepts leaves room to load.
LOAD_RESERVE_BYTES = 256 * 2**20


def compile_options_for(device) -> dict[str, str]:
    """XLA options that make the TPU compiler's own memory check leave LOAD_RESERVE_BYTES
    free (jax's device or an AOT topology's); none for other devices."""
    chip = chip_for_device_kind(device.device_kind) if device.platform == "tpu" else None
    if chip is None:
        return {}
    return {"xla_tpu_max_hbm_size_mib": str(int(chip.hbm_bytes - LOAD_RESERVE_BYTES) >> 20)}


def chip_named(name: str) -> Chip:
    """'v5p' or a topology such as 'v5p:4x4x4' -> the chip."""
    key = name.split(":")[0].lower()
    if key not in CHIPS:
        raise ValueError(f"unknown chip '{name}'; known: {', '.join(CHIPS)}")
    return CHIPS[key]


def multi_slice_chips() -> str:
    """'v5e, v5p, v6e or tpu7x': the chips whose slices a plan can join (a DCN figure)."""
    names = [chip.name for chip in CHIPS.values() if chip.dcn_bytes_per_s is not None]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """One device's share (Chip.per_device) of the chip whose longest matching name appears
    in jax's device_kind; None for CPU."""
    matches = [(len(kind), chip) for chip in CHIPS.values() for kind in chip.device_kinds
               if kind.lower() in device_kind.lower()]
    return max(matches, key=lambda m: m[0])[1].per_device() if matches else None


def topology_device_count(topology: str) -> int:
    """'v5p:4x4x4' -> 64 devices; 'tpu7x:4x4x4' -> 128 (two per chip)."""
    count = chip_named(topology).devices_per_chip
    for size in topology.split(":")[1].split("x"):
        count *= int(size)
    return count
