"""`lctrain plan`: its JSON, its table, the recipe's own strategy against the
recommendation, the mesh filled from a topology, and bad input as one line with exit 2.
The planner's figures themselves: tests/test_planner.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lctrain.cli.main import app
from lctrain.parallel import planner
from lctrain.parallel.chips import GB, gigabytes
from test_planner import CONTEXT4, TINY, V5P, tiny


def plan_cli(*args):
    return CliRunner().invoke(app, ["plan", *args])


def test_plan_json_schema():
    result = plan_cli("--topology", "v5p:2x2x1", *[f"--set={s}" for s in TINY], "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["chip"] == "v5p" and out["mesh"]["context"] == 4
    names = [s["strategy"] for s in out["strategies"]]
    assert names == ["all_gather", "ulysses", "usp", "ring"]
    for strategy in out["strategies"]:
        for key in ("hbm_bytes_per_device", "host_bytes_per_device", "comm_bytes_per_step"):
            assert isinstance(strategy[key], int) and strategy[key] >= 0
        assert isinstance(strategy["fits"], bool)
        assert set(strategy["comm_bytes_by_kind"]) == set(planner.KINDS)
        assert strategy["comm_bytes_per_step"] == pytest.approx(
            sum(strategy["comm_bytes_by_kind"].values()), abs=len(planner.KINDS))
        assert 0 < strategy["mfu_upper_bound"] <= 1
    assert out["recommendation"]["strategy"] in names
    assert out["recommendation"]["reason"]


@pytest.mark.parametrize("pinned", ["ring", "ulysses"])
def test_plan_shows_the_recipes_own_strategy_first_and_what_switching_changes(pinned):
    result = plan_cli("--topology", "v5p:2x2x1", *[f"--set={s}" for s in TINY],
                      f"--set=parallel.strategy={pinned}", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    plans = {s["strategy"]: s for s in out["strategies"]}
    assert out["strategies"][0]["strategy"] == pinned and out["recipe_strategy"] == pinned
    assert len(plans) == 4  # the others are still weighed
    best = out["recommendation"]["strategy"]
    line = out["against_recipe"]
    if best == pinned:  # the pick by estimate, or kept for a difference under its error
        assert (line == f"the recipe's {pinned} is the recommendation: keep it"
                or line.startswith(f"the recipe's {pinned} is kept: "))
    else:
        memory = plans[best]["hbm_bytes_per_device"] - plans[pinned]["hbm_bytes_per_device"]
        speed = plans[pinned]["step_time_s"] / plans[best]["step_time_s"] - 1
        assert line == (f"the recipe runs {pinned}; parallel.strategy={best} would take "
                        f"{gigabytes(abs(memory))} per device "
                        f"{'more' if memory > 0 else 'less'}, an estimated step "
                        f"{abs(speed):.1%} {'faster' if speed >= 0 else 'slower'}")
    table = plan_cli("--topology", "v5p:2x2x1", *[f"--set={s}" for s in TINY],
                     f"--set=parallel.strategy={pinned}")
    rows = [row for row in table.output.splitlines() if row.startswith("│")]
    assert rows[0].split("│")[1].strip().startswith(f"{pinned}") and "(recipe)" in rows[0]
    assert line in " ".join(table.output.split())


def plan_with_step_times(**seconds: float):
    """The tiny model's plan with every strategy compute-bound at the given step times
    (1 s where not given), recommended again."""
    result = planner.plan(tiny(), V5P, CONTEXT4)
    for p in result.plans:
        p.compute_s = seconds.get(p.strategy, 1.0)
    result.choice, result.reason = planner.recommend(result.plans)
    return result


def test_a_pinned_strategy_is_kept_for_a_difference_under_the_step_estimates_error():
    """Equal steps: the recommendation is the simplest, all_gather, but a recipe that names
    ring is not moved off it for an estimated step 0.0% slower (the plan said "the recipe
    runs ring; parallel.strategy=all_gather would take ..., an estimated step 0.0% slower")."""
    error = planner.STEP_TIME_ERROR
    result = plan_with_step_times()
    assert result.choice.strategy == "all_gather"
    line = planner.against_recipe(result, "ring")
    assert result.choice.strategy == "ring"
    assert result.reason.startswith("the recipe's own: it fits (")
    assert line.startswith("the recipe's ring is kept: parallel.strategy=all_gather")
    assert "an estimated step 0.0% " in line and f"error ({error:.0%})" in line
    # Faster, but by less than the error: kept too.
    result = plan_with_step_times(ring=1 + error / 2)
    planner.against_recipe(result, "ring")
    assert result.choice.strategy == "ring"
    # Faster by the error or more: the recommendation stands, and the line says what it gains.
    result = plan_with_step_times(ring=1 + 2 * error)
    line = planner.against_recipe(result, "ring")
    assert result.choice.strategy == "all_gather"
    assert line.startswith("the recipe runs ring; parallel.strategy=all_gather")
    assert "an estimated step 30.0% faster" in line


def test_a_pinned_strategy_that_does_not_fit_is_not_kept():
    result = plan_with_step_times()
    ring = next(p for p in result.plans if p.strategy == "ring")
    ring.hbm_capacity = 1.0  # nothing fits in a byte
    line = planner.against_recipe(result, "ring")
    assert result.choice.strategy == "all_gather"
    assert line.startswith("the recipe runs ring, which does not fit")


def rendered_plan(width: int, compiled: bool) -> tuple[str, planner.Plan]:
    """The tiny model's plan table, ring pinned, in a console `width` columns wide; with
    --compile's columns (XLA's figures faked: nothing is compiled here)."""
    import io

    from rich.console import Console

    from lctrain.cli.plan_render import render

    result = planner.plan(tiny(), V5P, CONTEXT4)
    for p in result.plans if compiled else []:
        p.compiled = {"hbm_bytes": 1.25 * p.hbm_bytes, "host_bytes": 0,
                      "collective_bytes": {"all-gather": 0.9 * p.comm_bytes}}
    line = planner.against_recipe(result, "ring")
    out = io.StringIO()
    render(result, Console(file=out, width=width), line, title="tiny, seq 4,096, v5p:2x2x1")
    return out.getvalue(), result


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("compiled", [False, True], ids=["estimate", "compile"])
def test_plan_table_is_whole_in_a_narrow_terminal(width, compiled):
    """At 80 and 100 columns the table was cut: the fits column read '…', and with
    --compile most columns did. Now it is stacked, every figure whole."""
    text, result = rendered_plan(width, compiled)
    assert "…" not in text
    table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and max(len(line) for line in table_lines) <= width
    for p in result.plans:
        figures = [f"{p.hbm_bytes / GB:,.2f}", f"{p.comm_bytes / GB:,.2f}", f"{p.mfu_bound:.0%}"]
        if compiled:
            figures += [f"{1.25 * p.hbm_bytes / GB:,.2f}", "-20.0%",
                        f"{0.9 * p.comm_bytes / GB:,.2f}", "+11.1%"]
        assert all(figure in text for figure in figures), (p.name, figures)
    assert "fits" in text
    # Each stacked table has every strategy's row.
    tables = sum(line.startswith("┏") for line in table_lines)
    assert text.count("ring (recipe)") == tables
    assert tables == 1 or text.count("(continued)") == tables - 1


def test_plan_table_and_max_seq():
    result = plan_cli("--topology", "v5p:2x2x1", *[f"--set={s}" for s in TINY], "--max-seq")
    assert result.exit_code == 0, result.output
    assert "recommended:" in result.output and "longest sequence" in result.output
    result = plan_cli("--topology", "v5p:2x2x1", *[f"--set={s}" for s in TINY], "--max-seq",
                      "--json")
    longest = json.loads(result.output)["max_seq_len"]
    assert set(longest) == {"all_gather", "ulysses", "usp(u=2)", "ring"}
    assert all(v["estimated"] > 4096 for v in longest.values())


def test_plan_fills_the_mesh_from_the_topology():
    result = plan_cli("--topology", "tpu7x:4x4x4", "--set", "mesh.data=1", "--set",
                      "mesh.context=-1", "--set", "parallel.strategy=auto", "--set",
                      "data.seq_len=4194304", "--set", "data.batch_size=1", "--set",
                      "model.preset=llama3.1-8b", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["mesh"]["context"] == 128                 # two devices per TPU7x chip
    assert out["hbm_bytes_per_device"] == 96e9
    assert [s["strategy"] for s in out["strategies"]] == ["all_gather", "usp", "ring"]


@pytest.mark.parametrize("args, message", [
    (["--topology", "v9x:2x2"], "unknown chip"),
    (["--topology", "v5p"], "chip:AxBxC"),
    (["--topology", "v5p:2x2x1", "--set", "mesh.context=3", "--set", "mesh.data=1",
      "--set", "parallel.strategy=ring"], "mesh"),
    (["--topology", "v5p:2x2x1", "--set", "model.nope=1"], "unknown recipe key"),
])
def test_plan_input_errors_exit_2_with_one_line(args, message):
    result = plan_cli(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
