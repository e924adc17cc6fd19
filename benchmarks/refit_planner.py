"""The planner's per-chip HBM estimate against the compiled figures of
benchmarks/data/planner_grid.jsonl (benchmarks/planner_grid.py), and a refit of its
calibration (parallel/planner/calibration.json, which memory.py's CALIBRATION reads).

    python benchmarks/refit_planner.py            # table, worst and rms error per grid
    python benchmarks/refit_planner.py --fit      # refit on the fit grid, write the file
    python benchmarks/refit_planner.py --fit --fit-grid fit --fit-grid small
    python benchmarks/refit_planner.py --record   # the accuracy alone, values kept

The error is (estimate - compiled) / compiled. Points XLA refused count with the bytes its
out-of-memory message says the program needs. --fit writes the refitted copy counts with
their provenance (date, toolchain, grids) and --fit and --record the estimate's accuracy
per grid and libtpu release, which the plan's notes quote (parallel/planner/accuracy.py);
review the change with `git diff` and record the round in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_grid import load_records, recipe_and_mesh, versions  # noqa: E402

from lctrain.parallel import chips, planner  # noqa: E402
from lctrain.parallel.planner.calibration import calibration, calibration_path  # noqa: E402

# CALIBRATION entries the 8B grid cannot decide, left at the small models' values
# (tests/test_planner.py's grid). None today: the MLP-chunk points (the MLP's [tokens, d_ff]
# intermediates one chunk at a time) part the layer's [tokens, d_model] tensors from them.
KEPT: tuple[str, ...] = ()
# The bound on every grid point; the refit aims a point inside it (XLA's figure
# for one point moved 3% between commits of the same code's neighbours), weighing each
# point's excess beyond its aim this much more than the rms.
TOLERANCE = 0.15
FIT_AIM = 0.14
EXCESS_WEIGHT = 10.0


def usable(records: list[dict], only_installed: bool = True) -> list[dict]:
    """Records with a compiled figure, from the installed jax / libtpu unless told not to."""
    installed = versions()
    return [r for r in records if r.get("hbm_bytes")
            and (not only_installed or r["versions"] == installed)]


@functools.cache
def _recipe_and_mesh(topology: str, overrides: tuple[str, ...]):
    """recipe_and_mesh, loaded once per point (the refit estimates each point many times)."""
    return recipe_and_mesh(topology, list(overrides))


def estimated_hbm(record: dict) -> float:
    """The planner's peak HBM per device for the record's recipe on its topology."""
    recipe, sizes = _recipe_and_mesh(record["topology"], tuple(record["overrides"]))
    chip = chips.chip_named(record["topology"]).per_device()
    return planner.estimate(recipe, sizes, chip, record["strategy"], record["ulysses"]).hbm_bytes


def relative_error(record: dict) -> float:
    return estimated_hbm(record) / record["hbm_bytes"] - 1


@contextlib.contextmanager
def calibrated(values: dict[str, float]):
    """The planner's CALIBRATION with `values` in place (the memory terms read it at call
    time), restored afterwards."""
    saved = dict(planner.CALIBRATION)
    planner.CALIBRATION.update(values)
    try:
        yield
    finally:
        planner.CALIBRATION.clear()
        planner.CALIBRATION.update(saved)


def summary(errors: list[float]) -> tuple[float, float]:
    """(worst |error|, rms error)."""
    return max(map(abs, errors)), math.sqrt(sum(e * e for e in errors) / len(errors))


def label(record: dict) -> str:
    strategy = (f"usp(u={record['ulysses']})" if record["strategy"] == "usp"
                else record["strategy"])
    model = record.get("model", "llama3.1-8b")
    return (f"{'' if model == 'llama3.1-8b' else model + ' '}{record['topology']} "
            f"{record['seq_len'] // 1024}K {record['remat']} {strategy}")


def print_table(records: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'grid':<8} {'point':<40} {'compiled GB':>11} {'estimate GB':>11} {'error':>8}")
    for grid in sorted({r["grid"] for r in records}):
        errors = []
        for r in (r for r in records if r["grid"] == grid):
            estimate = estimated_hbm(r)
            errors.append(estimate / r["hbm_bytes"] - 1)
            refused = "" if r["fits"] else " (does not fit)"
            print(f"{grid:<8} {label(r):<40} {r['hbm_bytes'] / 1e9:>11.2f} "
                  f"{estimate / 1e9:>11.2f} {100 * errors[-1]:>+7.1f}%{refused}")
        worst, rms = summary(errors)
        print(f"{grid:<8} {len(errors)} points: worst {100 * worst:.1f}%, rms {100 * rms:.1f}%")


def accuracy_of(records: list[dict], tolerance: float = TOLERANCE) -> dict:
    """Points, worst |error| and rms per grid, with the points beyond `tolerance`."""
    grids = {}
    for grid in sorted({r["grid"] for r in records}):
        errors = {label(r): relative_error(r) for r in records if r["grid"] == grid}
        worst, rms = summary(list(errors.values()))
        grids[grid] = {"points": len(errors), "worst": round(worst, 3), "rms": round(rms, 3),
                       "outside": {name: round(error, 3) for name, error in errors.items()
                                   if abs(error) > tolerance}}
    return grids


def accuracy_by_libtpu(records: list[dict]) -> dict:
    """accuracy_of for the points each libtpu release compiled (the estimate is the
    same formula whatever is installed; the compiled figures are each release's own)."""
    return {libtpu: {"jax": next(r["versions"]["jax"] for r in records
                                 if r["versions"]["libtpu"] == libtpu),
                     "grids": accuracy_of([r for r in records
                                           if r["versions"]["libtpu"] == libtpu])}
            for libtpu in sorted({r["versions"]["libtpu"] for r in records})}


def write_calibration(all_records: list[dict], fitted: dict[str, float] | None = None,
                      fit_grids: list[str] | None = None) -> None:
    """Write calibration.json: the copies `fitted` with their provenance where given, and
    the accuracy of the values then in force on every recorded toolchain's points. What
    each term counts and the notes on what the grid does not cover are kept."""
    document = json.loads(json.dumps(calibration()))
    today = datetime.date.today().isoformat()
    if fitted:
        for name, value in fitted.items():
            document["terms"][name]["copies"] = value
        document["fitted"].update(
            date=today, fit_grids=fit_grids,
            toolchain={"python": ".".join(platform.python_version_tuple()[:2]), **versions()})
    with calibrated(fitted or {}):
        document["accuracy"].update(recorded=today,
                                    by_libtpu=accuracy_by_libtpu(all_records))
    calibration_path().write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nwrote {calibration_path()}")


def print_outside(records: list[dict], tolerance: float = TOLERANCE) -> None:
    """The points beyond `tolerance`, as tests/test_planner_grid.py's OUTSIDE lists them."""
    print(f"\noutside {tolerance:.0%} (tests/test_planner_grid.py OUTSIDE):")
    for r in records:
        if abs(error := relative_error(r)) > tolerance:
            print(f'    "{label(r)}": {error:+.3f},')


def terms_that_matter(records: list[dict]) -> list[str]:
    """The CALIBRATION entries that move some record's estimate when nudged (10% up, at
    least 0.05): an entry whose term reaches no record's peak stays as it is, rather than
    drift where the records do not decide it."""
    base = [estimated_hbm(r) for r in records]
    moving = []
    for name, value in planner.CALIBRATION.items():
        with calibrated({name: value + max(0.1 * value, 0.05)}):
            if any(abs(estimated_hbm(r) - b) > 1e-6 * b for r, b in zip(records, base)):
                moving.append(name)
    return moving


def refit(records: list[dict], tolerance: float = FIT_AIM) -> dict[str, float]:
    """Nonnegative CALIBRATION values that bring as many of `records` as they can within
    `tolerance` and then the rms relative error down: rms plus a steep penalty on each
    point's excess beyond the tolerance, so that a point no value brings in (XLA's figure
    moving where no term follows it) does not pull every other point off with it, as a
    worst-error objective would (the peak is a max of phases, so not linear in them: a
    derivative-free search)."""
    from scipy.optimize import minimize
    names = [n for n in terms_that_matter(records) if n not in KEPT]
    start = np.array([planner.CALIBRATION[n] for n in names])

    def objective(values: np.ndarray) -> float:
        with calibrated(dict(zip(names, np.abs(values)))):
            errors = [relative_error(r) for r in records]
        excess = sum(max(abs(e) - tolerance, 0.0) for e in errors)
        return summary(errors)[1] + EXCESS_WEIGHT * excess

    best = minimize(objective, start, method="Powell", options={"xtol": 1e-3, "ftol": 1e-5})
    return {n: round(float(abs(v)), 3) for n, v in zip(names, best.x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true",
                        help="refit CALIBRATION on the fit grid, show its errors and write "
                             "parallel/planner/calibration.json")
    parser.add_argument("--record", action="store_true",
                        help="write the accuracy of today's CALIBRATION alone (after "
                             "recompiling grid points)")
    parser.add_argument("--fit-grid", action="append",
                        help="grids the refit minimises the error on (repeat; default: fit; "
                             "add small to keep tests/test_planner.py's grid in bounds)")
    parser.add_argument("--any-version", action="store_true",
                        help="also use points compiled with other jax / libtpu versions")
    args = parser.parse_args()
    records = usable(load_records(), only_installed=not args.any_version)
    if not records:
        sys.exit("no compiled points for the installed jax / libtpu: run "
                 "benchmarks/planner_grid.py first")
    print_table(records, "CALIBRATION today")
    print_outside(records)
    every_toolchain = usable(load_records(), only_installed=False)
    if args.record:
        write_calibration(every_toolchain)
    if not args.fit:
        return
    fit_grids = args.fit_grid or ["fit"]
    proposal = refit([r for r in records if r["grid"] in fit_grids])
    print(f"\nrefitted CALIBRATION (the entries {', '.join(fit_grids)} moves):")
    for name, value in proposal.items():
        print(f"    {name!r}: {value},   # was {planner.CALIBRATION[name]}")
    with calibrated(proposal):
        print_table(records, "refitted CALIBRATION")
    write_calibration(every_toolchain, proposal, fit_grids)


if __name__ == "__main__":
    main()
