"""The planner's per-chip HBM estimate against XLA's compiled figure for llama3.1-8b at
128K-8M tokens (benchmarks/data/planner_grid.jsonl, from benchmarks/planner_grid.py;
issue 19): one case per stored point compiled with the installed jax and libtpu (fast: the
figures are stored), and one slow case that recompiles a stored point to check the data
still says what the compiler does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tpu_aot import needs_libtpu

from lctrain.parallel.planner import accuracy

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks are scripts, not a package
grid = pytest.importorskip("planner_grid")
refit = pytest.importorskip("refit_planner")

TOLERANCE = 0.15
RECOMPILE_TOLERANCE = 0.005
# Points the formulas do not follow yet (refit_planner.label -> error), as
# parallel/planner/calibration.json records them for the installed libtpu: each is expected
# to fail, and passes the day the planner follows it. The plan names the release its
# calibration comes from (parallel/planner/accuracy.py); benchmarks/RESULTS.md says what is
# known about each point.
MEASURED = accuracy.accuracy()["by_libtpu"].get(grid.versions()["libtpu"], {})
OUTSIDE = {name: error for measured in MEASURED.get("grids", {}).values()
           for name, error in measured["outside"].items()}

RECORDS = refit.usable(grid.load_records())


def case(record: dict):
    name = refit.label(record)
    marks = ([pytest.mark.xfail(strict=True, reason=f"estimate {OUTSIDE[name]:+.1%} off")]
             if name in OUTSIDE else [])
    return pytest.param(record, id=name.replace(" ", "-"), marks=marks)


def no_records_case():
    """One visible skip where the grid has no point for the installed toolchain."""
    installed = grid.versions()
    recorded = sorted({f"jax {r['versions']['jax']} / libtpu {r['versions']['libtpu']}"
                       for r in grid.load_records()})
    return pytest.param(None, id="no-points-for-the-installed-toolchain", marks=pytest.mark.skip(
        reason=f"benchmarks/data/planner_grid.jsonl has no point compiled with jax "
               f"{installed['jax']} / libtpu {installed['libtpu']} (it has: "
               f"{', '.join(recorded) or 'none'}); record them with "
               f"python benchmarks/planner_grid.py"))


@pytest.mark.parametrize("record", [case(r) for r in RECORDS] or [no_records_case()])
def test_estimate_within_tolerance_of_the_compiled_figure(record):
    error = refit.relative_error(record)
    assert abs(error) <= TOLERANCE, f"estimate {error:+.1%} off XLA's {record['hbm_bytes']:,} B"


def test_the_mlp_chunk_points_compile_the_1m_recipe():
    """The fit grid's MLP-chunk point is recipes/llama3_8b_1m.yaml on its 4 chips, so the
    grid checks the estimate benchmarks/RESULTS.md quotes for it."""
    from lctrain.recipes import load_recipe

    point = grid.Point("fit", "v5p:2x2x1", "ring", "offload_mlp_chunks", 2**20)
    recipe, _ = grid.recipe_and_mesh(point.topology, point.overrides)
    reference = load_recipe(str(BENCHMARKS.parent / "recipes" / "llama3_8b_1m.yaml"), [])
    for section in ("model", "mesh", "parallel", "attention", "remat", "loss"):
        assert getattr(recipe, section) == getattr(reference, section), section
    assert (recipe.data.seq_len, recipe.data.batch_size) == (2**20, 1)


def test_a_recompiled_point_replaces_its_record(tmp_path):
    path = tmp_path / "grid.jsonl"
    first = {"topology": "v5p:2x2x1", "overrides": ["a=1"],
             "versions": {"jax": "1", "libtpu": "2"}, "hbm_bytes": 1}
    other = {**first, "overrides": ["a=2"]}
    for record in (first, other, {**first, "hbm_bytes": 2}):
        grid.store(record, path)
    assert [(r["overrides"], r["hbm_bytes"]) for r in grid.load_records(path)] == [
        (["a=2"], 1), (["a=1"], 2)]



def test_each_refused_point_stores_the_figures_its_message_gives():
    """The refusals on record (libtpu 0.0.42's "HLO temporaries (...)" wording) read again
    by parallel/xla_failures.py, the parser the run and auto share, give the stored bytes."""
    refused = [r for r in grid.load_records() if r["fits"] is False]
    assert refused
    for record in refused:
        stored = {field: record[field] for field in ("hbm_bytes", "temp_bytes", "capacity_bytes")
                  if record.get(field) is not None}
        assert grid.needed_bytes(record["error"]) == stored

@pytest.mark.slow
@needs_libtpu
def test_stored_figure_is_what_the_compiler_says():
    from lctrain.parallel import aot
    fitting = [r for r in RECORDS if r["fits"]]
    if not fitting:
        pytest.skip("no stored point compiled with the installed jax / libtpu")
    cheapest = min(fitting, key=lambda r: r["compile_s"])
    point = grid.point_of(cheapest)
    again = grid.compile_point(point, aot.topology_devices(point.topology))
    assert again["hbm_bytes"] == pytest.approx(cheapest["hbm_bytes"], rel=RECOMPILE_TOLERANCE)


def test_the_plan_warns_exactly_where_the_estimate_misses():
    """`lctrain plan` prints a note where the estimate is known to be low
    (parallel/planner/accuracy.py): every stored point it does not warn about lies within
    the tolerance, and it warns about every point outside."""
    from lctrain.parallel.planner.accuracy import estimate_note

    if not RECORDS:
        pytest.skip("no stored point compiled with the installed jax / libtpu")
    for record in RECORDS:
        recipe, sizes = grid.recipe_and_mesh(record["topology"], record["overrides"])
        within = abs(refit.relative_error(record)) <= TOLERANCE
        assert within or estimate_note(recipe, sizes) is not None, refit.label(record)
