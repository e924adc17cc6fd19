"""What XLA and libtpu said when a program failed, read in one place for the run, the plan,
auto's fall-backs and the benchmarks.

A failure is one of:
  - HBM_OOM: the TPU compiler refused a program over the chip's HBM, with its figure in
    one of two wordings: "Ran out of memory in memory space hbm. Used 97.24G of 95.74G
    hbm." (the whole need), or libtpu 0.0.42's "the total memory required for HLO
    temporaries (97.06G) exceeds available HBM (95.74G)" (the temporaries alone);
  - SCOPED_VMEM_OOM: a kernel's tiles overflow a core's scoped VMEM (libtpu's E1001
    CompileTimeScopedVmemOom): a tile problem, not HBM;
  - RUNTIME_OOM: an allocation failed while the program was loaded or ran (libtpu's E0101
    RuntimeProgramAllocationFailure, "Attempting to allocate 30.01M"; the CPU and GPU
    allocators' "Out of memory allocating 17592186044416 bytes");
  - OUT_OF_MEMORY: RESOURCE_EXHAUSTED in a wording none of the above knows;
  - COMPILER_FAILED: an XLA error that is not about memory (libtpu 0.0.50: "UNIMPLEMENTED:
    No feasible span count for single input all reduce scatter fusion ...").

XLA writes amounts in binary units ("G" is 2**30, tsl's HumanReadableNumBytes); the
figures here are bytes. No jax here: it reads the error's class name and text only.
"""

from __future__ import annotations

import dataclasses
import re

HBM_OOM = "out of HBM"
SCOPED_VMEM_OOM = "out of scoped VMEM"
RUNTIME_OOM = "allocation failed"
OUT_OF_MEMORY = "out of memory"
# Also how the plan and auto record such a refusal: "compiler failed: <XLA's line>".
COMPILER_FAILED = "compiler failed"

# "97.24G", "30.01M", "4.00GiB" or "17592186044416 bytes"
_AMOUNT = r"(\d+(?:\.\d+)?) ?([KMGT]i?B?|bytes)"
_USED = re.compile(rf"Used {_AMOUNT} of {_AMOUNT} hbm")
_TEMPORARIES = re.compile(rf"HLO temporaries \({_AMOUNT}\) exceeds available HBM \({_AMOUNT}\)")
_ALLOCATION = re.compile(rf"(?:allocating|allocate) {_AMOUNT}")
# Kept to this many characters of XLA's first line: its messages can run to pages.
_LINE_CHARS = 300


@dataclasses.dataclass(frozen=True)
class XlaFailure:
    kind: str                           # one of the kinds above
    first_line: str                     # XLA's first line, cut to _LINE_CHARS
    needed_bytes: int | None = None     # HBM_OOM: what the program needs per device
    capacity_bytes: int | None = None   # HBM_OOM: the HBM the compiler had
    temporaries_only: bool = False      # needed_bytes counts the temporaries alone
    allocation_bytes: int | None = None  # RUNTIME_OOM: the one allocation that failed

    @property
    def out_of_memory(self) -> bool:
        return self.kind != COMPILER_FAILED

    @property
    def recorded(self) -> str:
        """How a plan or auto's fall-back records the refusal: XLA's first line, marked
        when the compiler failed for another reason than memory."""
        if self.out_of_memory:
            return self.first_line
        return f"{COMPILER_FAILED}: {self.first_line}"


def is_xla_error(err: BaseException) -> bool:
    """An error XLA raised (jax names its class differently across versions)."""
    return type(err).__name__ in ("JaxRuntimeError", "XlaRuntimeError")


def classify(err: BaseException) -> XlaFailure | None:
    """What `err` says, None when XLA did not raise it."""
    return classify_message(str(err)) if is_xla_error(err) else None


def classify_message(text: str) -> XlaFailure:
    """What an XLA error's text says (a message kept from an earlier compile, too)."""
    first_line = (text.strip().splitlines() or [""])[0][:_LINE_CHARS]
    if "RESOURCE_EXHAUSTED" not in text:
        return XlaFailure(COMPILER_FAILED, first_line)
    if "ScopedVmemOom" in text:
        return XlaFailure(SCOPED_VMEM_OOM, first_line)
    if found := _USED.search(text) or _TEMPORARIES.search(text):
        needed, capacity = _bytes(*found.group(1, 2)), _bytes(*found.group(3, 4))
        return XlaFailure(HBM_OOM, first_line, needed, capacity,
                          temporaries_only=found.re is _TEMPORARIES)
    if found := _ALLOCATION.search(text):
        return XlaFailure(RUNTIME_OOM, first_line, allocation_bytes=_bytes(*found.groups()))
    if "RuntimeProgramAllocationFailure" in text:
        return XlaFailure(RUNTIME_OOM, first_line)
    return XlaFailure(HBM_OOM if "hbm" in text.lower() else OUT_OF_MEMORY, first_line)


def _bytes(number: str, unit: str) -> int:
    """XLA's amount in bytes: its K, M, G and T are binary."""
    if unit == "bytes":
        return int(number)
    return round(float(number) * 1024 ** ("KMGT".index(unit[0]) + 1))
