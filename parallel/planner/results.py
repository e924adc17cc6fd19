"""The planner's results: one strategy's plan and the plan of all of them, with their JSON."""

from __future__ import annotations

import dataclasses

from lctrain.parallel import STRATEGIES
from lctrain.parallel.chips import LOAD_RESERVE_BYTES, Chip
from lctrain.parallel.planner.calibration import peak_share
from lctrain.parallel.xla_failures import COMPILER_FAILED

# How a compile whose process libtpu killed is recorded (compiled.aborted_figures), and one
# that lctrain's device checks refused before compiling (compiled.compile_figures); one
# that XLA refused for a reason other than memory is COMPILER_FAILED's.
ABORTED = "compiler aborted"
REFUSED = "refused before compiling"


@dataclasses.dataclass
class StrategyPlan:
    strategy: str
    ulysses: int                                  # Ulysses degree where it takes one
    memory: dict[str, float]                      # HBM bytes per device by term
    peak_terms: tuple[str, ...]                   # the terms alive together at the peak
    peak_phase: str                               # loss, layer_mlp or layer_attention
    host: dict[str, float]                        # pinned host bytes per device by term
    comm: dict[str, float]                        # bytes received per step per device, by kind
    comm_detail: dict[str, float]                 # the same by source (zero3, strategy, ...)
    compute_s: float                              # step compute at peak (with recompute)
    comm_s: float                                 # step communication at link bandwidth
    exposed_s: float                              # the part of comm_s on the critical path
    model_flops: float                            # per device per step (no recompute)
    peak_flops: float
    ring_hidden: bool | None                      # with a ring: its sends hide behind work
    hbm_capacity: float
    host_capacity: float
    compiled: dict | None = None                  # --compile: XLA's own figures
    kinds: dict | None = None                     # model.layer_pattern: kind -> KindPlan

    @property
    def name(self) -> str:
        if self.kinds is not None:
            return ", ".join(f"{kind}: {self.kind_name(part.strategy)}"
                             for kind, part in self.kinds.items())
        return self.kind_name(self.strategy)

    def kind_name(self, strategy: str) -> str:
        if STRATEGIES[strategy].takes_ulysses_degree:
            return f"{strategy}(u={self.ulysses})"
        return strategy

    @property
    def hbm_bytes(self) -> float:
        """Peak HBM per device: the terms of the whole step plus the larger phase."""
        return sum(self.memory[t] for t in self.peak_terms)

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values())

    @property
    def comm_bytes(self) -> float:
        return sum(self.comm.values())

    @property
    def step_s(self) -> float:
        """Estimated step time: the compute, or the traffic that can overlap it (weights,
        gradients, the ring's sends while they hide), whichever is longer, plus the
        traffic the next operation waits for (K/V gathers, all-to-alls, exposed sends)."""
        return max(self.compute_s, self.comm_s - self.exposed_s) + self.exposed_s

    @property
    def mfu_bound(self) -> float:
        """Model flops over peak x estimated step time: no kernel is faster than peak and
        no collective faster than the link bandwidth, so the real MFU is lower."""
        return min(self.model_flops / (self.peak_flops * max(self.step_s, 1e-30)), 1.0)

    @property
    def fits(self) -> bool:
        """The estimate fits as the compiler would take it, and in the host memory. The
        estimate is of the buffers' sum; libtpu checks XLA's peak, at most calibration.json's
        peak_share of it for the phase the step peaks in, against the HBM less what loading
        needs."""
        in_groups = self.memory.get("group_inputs", 0.0) > 0
        return (self.hbm_bytes * peak_share(self.peak_phase, in_groups)
                <= self.hbm_capacity - LOAD_RESERVE_BYTES
                and self.host_bytes <= self.host_capacity)

    @property
    def compile_failed(self) -> bool:
        """The compiler died on this strategy, or refused it for a reason other than its
        memory, or the device checks refused it: no figures, and not a candidate."""
        return ((self.compiled or {}).get("error") or "").startswith((ABORTED, COMPILER_FAILED,
                                                                       REFUSED))

    @property
    def deciding_hbm_bytes(self) -> float:
        """The peak the recommendation goes by: XLA's when compiled (--compile), else (or
        where XLA refused the program) the estimate."""
        compiled = (self.compiled or {}).get("hbm_bytes")
        return self.hbm_bytes if compiled is None else compiled

    @property
    def deciding_fits(self) -> bool:
        """Whether the recommendation counts this strategy as fitting: by XLA's figures in
        the chip's whole HBM when compiled, else by the estimate (fits)."""
        if self.compiled is None:
            return self.fits
        return self.compiled_json()["compiled_fits"]

    def as_json(self) -> dict:
        out = {
            "strategy": self.strategy, "ulysses": self.ulysses,
            "hbm_bytes_per_device": int(self.hbm_bytes),
            "host_bytes_per_device": int(self.host_bytes),
            "comm_bytes_per_step": int(self.comm_bytes),
            "comm_bytes_by_kind": {k: int(v) for k, v in self.comm.items()},
            "comm_bytes_by_source": {k: int(v) for k, v in self.comm_detail.items()},
            "memory_bytes_by_term": {k: int(v) for k, v in self.memory.items()},
            "memory_peak_phase": self.peak_phase,
            "memory_terms_at_peak": list(self.peak_terms),
            "host_bytes_by_term": {k: int(v) for k, v in self.host.items()},
            "compute_time_s": self.compute_s, "comm_time_s": self.comm_s,
            "exposed_comm_time_s": self.exposed_s, "step_time_s": self.step_s,
            "mfu_upper_bound": self.mfu_bound, "ring_comm_hidden": self.ring_hidden,
            "fits": self.fits,
        }
        if self.kinds is not None:
            out["layer_kinds"] = {kind: dataclasses.asdict(part)
                                  for kind, part in self.kinds.items()}
        if self.compiled is not None:
            out.update(self.compiled_json())
        return out

    def compiled_json(self) -> dict:
        c = self.compiled
        hbm, host = c.get("hbm_bytes"), c.get("host_bytes")
        return {
            "compiled_hbm_bytes_per_device": hbm,
            "compiled_host_bytes_per_device": host,
            "compiled_comm_bytes_by_kind": c.get("collective_bytes"),
            "compiled_comm_bytes_per_step": (sum(c["collective_bytes"].values())
                                             if c.get("collective_bytes") else None),
            "hbm_gap_percent": gap_percent(self.hbm_bytes, hbm),
            "comm_gap_percent": (gap_percent(self.comm_bytes,
                                             sum(c["collective_bytes"].values()))
                                 if c.get("collective_bytes") else None),
            "compiled_peak_bytes_per_device": c.get("peak_bytes"),
            "compiled_fits": fits_as_compiled(hbm, host, self.host_capacity),
            "compile_error": c.get("error"),
        }


def fits_as_compiled(hbm_bytes: float | None, host_bytes: float | None,
                     host_capacity: float) -> bool:
    """Whether a program XLA compiled for a TPU fits the chip. libtpu refuses a program
    whose peak (memory_analysis().peak_memory_in_bytes) exceeds the chip's HBM less
    chips.LOAD_RESERVE_BYTES (RESOURCE_EXHAUSTED, no figures), so having a figure means it
    fits. The figure compared with the estimate, memory_analysis()'s sum of arguments,
    outputs and temporaries (what MaxText prints too), is larger than that peak: its
    temporaries include buffers never alive together. Host memory, which nothing else
    checks, is checked here."""
    return hbm_bytes is not None and (host_bytes or 0) <= host_capacity


def gap_percent(estimate: float, compiled: float | None) -> float | None:
    """(estimate - compiled) / compiled in %, None without a compiled figure."""
    if not compiled:
        return None
    return 100.0 * (estimate - compiled) / compiled


@dataclasses.dataclass
class Plan:
    chip: Chip
    axis_sizes: dict[str, int]
    plans: list[StrategyPlan]
    skipped: dict[str, str]                       # strategy -> why it cannot run here
    choice: StrategyPlan | None
    reason: str
    note: str | None = None                       # where the estimate is known to be off

    def as_json(self) -> dict:
        return {
            "chip": self.chip.name, "hbm_bytes_per_device": self.chip.hbm_bytes,
            "host_bytes_per_device": self.chip.host_bytes, "mesh": self.axis_sizes,
            "strategies": [p.as_json() for p in self.plans],
            "not_applicable": self.skipped,
            "estimate_note": self.note,
            "recommendation": None if self.choice is None else {
                "strategy": self.choice.strategy, "ulysses": self.choice.ulysses,
                "reason": self.reason},
        }
