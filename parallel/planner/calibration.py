"""The planner's calibration: parallel/planner/calibration.json, package data.

It holds how many copies of each memory term XLA keeps alive (memory.py's CALIBRATION),
the toolchain and compiled grid they were fitted on, and how far the estimate is from
the compiled figures (accuracy.py's notes). `python benchmarks/refit_planner.py --fit`
writes it; nothing in code restates its figures.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

FILE_NAME = "calibration.json"


def calibration_path() -> Path:
    """Where the file lives, in the source tree or the installed package alike."""
    return Path(str(resources.files(__package__) / FILE_NAME))


@functools.cache
def calibration() -> dict:
    """The whole file, read once (callers copy what they change)."""
    return json.loads(calibration_path().read_text())


def fitted_copies() -> dict[str, float]:
    """Each term's fitted copy count, as a new dict."""
    return {name: term["copies"] for name, term in calibration()["terms"].items()}


def accuracy() -> dict:
    """The estimate against the compiled grid, per libtpu release, and the notes on what
    the grid does not cover."""
    return calibration()["accuracy"]


def peak_share(peak_phase: str, in_groups: bool = False) -> float:
    """XLA's peak over the estimate of a program that peaks in `peak_phase` (memory.PHASES),
    the highest measured: the estimate's fit rule. Programs that checkpoint in groups of
    layers have their own: their recomputed group inputs are a term set by hand."""
    key = f"{peak_phase}_in_groups" if in_groups else peak_phase
    return calibration()["peak_share"]["by_peak_phase"][key]
