"""`plan --compile` and `--max-seq` stay quick: XLA's figures are cached on disk per
(recipe, devices, toolchain), out-of-memory refusals included, and the strategies of one
plan compile in parallel processes (the pool test compiles for a TPU topology: slow)."""

import functools
import importlib.util
import io

import pytest
from rich.console import Console

from lctrain.parallel import chips, planner
from lctrain.parallel.planner import compiled
from lctrain.recipes import RecipeError, check_against_devices, load_recipe
from lctrain.trainer.outputs.progress import timed

BASE = ["parallel.strategy=auto", "mesh.context=4", "mesh.data=1", "data.seq_len=4096",
        "data.batch_size=1"]
V5P = chips.chip_named("v5p:2x2x1").per_device()


class FakeTpu:
    """What the cache key reads of a device."""
    platform, device_kind, core_on_chip = "tpu", "TPU v5", 0

    def __init__(self, *coords):
        self.coords = list(coords)


V5P_2X2X1 = [FakeTpu(x, y, 0) for y in range(2) for x in range(2)]
V5P_4X1X1 = [FakeTpu(x, 0, 0) for x in range(4)]


@pytest.fixture
def compiles(monkeypatch, tmp_path) -> list:
    """The recipes compile_figures is asked to compile (a fake: hbm by sequence length,
    XLA's refusal for ring), with the cache in a fresh folder."""
    monkeypatch.setenv("LCTRAIN_CACHE", str(tmp_path / "cache"))
    asked = []

    def fake_compile(recipe, devices, compile_step):
        asked.append(recipe)
        if recipe.parallel.strategy == "ring":
            return {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
                    "error": "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm."}
        return {"hbm_bytes": recipe.data.seq_len * 2**17, "host_bytes": 0,
                "collective_bytes": {"all-gather": len(devices)}, "temp_bytes": 0,
                "argument_bytes": 0}

    monkeypatch.setattr(compiled, "compile_figures", fake_compile)
    return asked


def attach(overrides=(), devices=V5P_2X2X1):
    recipe = load_recipe("tiny", [*BASE, *overrides])
    result = planner.plan(recipe, V5P, check_against_devices(recipe, 4), "tpu")
    console = Console(file=io.StringIO(), width=200)
    planner.attach_compiled(result, recipe, devices, None,
                            timed=functools.partial(timed, console))
    return result, console.file.getvalue()


def test_a_second_plan_compile_reads_every_figure_from_the_cache(compiles):
    first, printed = attach()
    strategies = len(first.plans)
    assert len(compiles) == strategies and "cached" not in printed
    assert "ring" in [p.strategy for p in first.plans]
    compiles.clear()
    second, printed = attach()
    assert compiles == []
    assert [p.compiled for p in second.plans] == [p.compiled for p in first.plans]
    ring = next(p for p in second.plans if p.strategy == "ring")
    assert ring.compiled["error"].startswith("RESOURCE_EXHAUSTED")   # refusals are cached
    assert printed.count(": cached\n") == strategies
    assert f"compiled {ring.name}, seq 4,096, for 4 devices: cached" in printed
    assert second.choice.name == first.choice.name


@pytest.mark.parametrize("changed", [{"overrides": ["model.d_ff=512"]},
                                     {"overrides": ["train.lr=0.01"]},
                                     {"devices": V5P_4X1X1}])
def test_a_changed_recipe_value_or_topology_compiles_again(compiles, changed):
    first, _ = attach()
    compiles.clear()
    attach(**changed)
    assert len(compiles) == len(first.plans)


def test_max_seq_search_reads_the_cache(compiles):
    recipe = load_recipe("tiny", BASE)
    result = planner.plan(recipe, V5P, check_against_devices(recipe, 4), "tpu")
    first = planner.longest_sequences(result, recipe, "tpu", V5P_2X2X1, None)
    searched = len(compiles)
    assert searched > len(result.plans)
    compiles.clear()
    assert planner.longest_sequences(result, recipe, "tpu", V5P_2X2X1, None) == first
    assert compiles == []
    # --no-cache: every length compiles again.
    assert planner.longest_sequences(result, recipe, "tpu", V5P_2X2X1, None,
                                     use_cache=False) == first
    assert len(compiles) == searched


def test_devices_without_a_description_are_not_cached(compiles):
    """The fake devices of tests/test_failures.py: nothing to key on, so every call
    compiles."""
    result, _ = attach(devices=[None] * 4)
    attach(devices=[None] * 4)
    assert len(compiles) == 2 * len(result.plans)


def test_workers_are_capped_by_cores_and_memory(monkeypatch):
    monkeypatch.setattr(compiled.os, "cpu_count", lambda: 16)
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(compiled.os, "sysconf", lambda name: pages.get(
        name, 3 * compiled.COMPILE_HOST_BYTES // 4096))
    assert compiled.compile_workers(4) == 3          # memory for three compiles
    assert compiled.compile_workers(2) == 2          # no more than the jobs
    monkeypatch.setattr(compiled.os, "sysconf", lambda name: pages.get(name, 1))
    assert compiled.compile_workers(4) == 1          # at least one
    monkeypatch.setattr(compiled.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(compiled.os, "sysconf", lambda name: pages.get(name, 2**30))
    assert compiled.compile_workers(4) == 2          # this 2-core machine


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="TPU AOT compiles need libtpu (the tpu extra)")
def test_processes_give_the_serial_figures(monkeypatch, tmp_path):
    """A tiny recipe on v5p:2x2x1: two worker processes compile two of the plan's
    strategies and give the figures of compiling them here, in this process (without
    make_devices)."""
    from lctrain.parallel import aot
    from lctrain.trainer.state.build import compile_train_step

    recipe = load_recipe("tiny", [*BASE, "model.layers=1", "model.dtype=bfloat16",
                                "attention.impl=xla", "data.seq_len=1024"])
    sizes = check_against_devices(recipe, 4)
    devices = aot.topology_devices("v5p:2x2x1")
    here = []
    real_compile = compiled.compile_figures
    monkeypatch.setattr(compiled, "compile_figures",
                        lambda r, d, step: here.append(r) or real_compile(r, d, step))
    runs = {}
    for workers in (2, 1):
        monkeypatch.setenv("LCTRAIN_CACHE", str(tmp_path / f"cache{workers}"))
        result = planner.plan(recipe, V5P, sizes, "tpu")
        result.plans = result.plans[:2]
        console = Console(file=io.StringIO(), width=200)
        rebuild = functools.partial(aot.topology_devices, "v5p:2x2x1") if workers > 1 else None
        planner.attach_compiled(result, recipe, devices, compile_train_step,
                                functools.partial(timed, console), make_devices=rebuild,
                                workers=workers)
        runs[workers] = ([p.compiled for p in result.plans], console.file.getvalue())
    assert len(here) == len(result.plans)              # the in-process run only
    assert runs[2][0] == runs[1][0]
    assert all(figures["hbm_bytes"] > 0 for figures in runs[2][0])
    for p in result.plans:
        assert f"compiled {p.name}, seq 1,024, for 4 devices: " in runs[2][1]


def aborting_devices():
    """What libtpu does on a failed CHECK: a fatal line on file descriptor 2, then abort."""
    import os

    os.write(2, b"I1205 08:32:34.100000    5883 some_pass.cc:10] compiling\n"
                b"F1205 08:32:34.630836    5883 rotated_pincer_fusion_emitter.cc:1904] Check "
                b"failed: s_count.has_value() \n*** Check failure stack trace: ***\n")
    os.abort()


def test_a_compile_the_compiler_aborts_is_that_strategys_row(monkeypatch, tmp_path):
    """libtpu kills the process it compiles in: the compile runs in a process of its own,
    so the plan goes on, and the row says what the compiler said."""
    monkeypatch.setenv("LCTRAIN_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe("tiny", BASE)
    result = planner.plan(recipe, V5P, check_against_devices(recipe, 4), "tpu")
    console = Console(file=io.StringIO(), width=200)
    aborted = result.plans[0]
    figures = compiled.compile_in_processes({"compiled x": recipe}, aborting_devices, None, 1,
                                            functools.partial(timed, console))["compiled x"]
    assert figures == {"hbm_bytes": None, "host_bytes": None, "collective_bytes": None,
                       "error": "compiler aborted: Check failed: s_count.has_value() "
                                "(rotated_pincer_fusion_emitter.cc:1904)"}
    assert "compiled x: aborted" in console.file.getvalue()
    for p in result.plans:
        p.compiled = {"hbm_bytes": 2**30, "host_bytes": 0, "collective_bytes": {}}
    aborted.compiled = figures
    choice, reason = planner.recommend(result.plans)
    assert choice is not aborted and aborted.compile_failed and not aborted.deciding_fits
    assert f"the compiler failed on {aborted.name}" in reason and "would not fit" not in reason


def test_a_recipe_the_device_checks_refuse_is_that_strategys_row():
    """plan --compile builds each strategy's step as a run does, through the device checks
    (trainer/state/device_checks.py): a refusal there is the row's error, naming the key,
    and takes the strategy out of the recommendation (it printed a traceback before)."""
    recipe = load_recipe("tiny", BASE)
    result = planner.plan(recipe, V5P, check_against_devices(recipe, 4), "tpu")

    def refuse(recipe, devices):
        raise RecipeError("recipe key 'data.seq_len' = 4096: too long for something")

    figures = compiled.compile_figures(recipe, V5P_2X2X1, refuse)
    assert figures["error"] == ("refused before compiling: recipe key 'data.seq_len' = 4096: "
                                "too long for something")
    refused, *others = result.plans
    for p in others:
        p.compiled = {"hbm_bytes": 2**30, "host_bytes": 0, "collective_bytes": {}}
    refused.compiled = figures
    choice, _ = planner.recommend(result.plans)
    assert refused.compile_failed and choice is not refused


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="TPU AOT compiles need libtpu (the tpu extra)")
def test_plan_compile_survives_a_compiler_failure_on_one_strategy(tmp_path):
    """docs/failures.md's case: all_gather's dK/dV reduce-scatter at 3,072 tokens per
    chip, which libtpu 0.0.42.1 aborts on (Check failed: s_count.has_value()) and 0.0.50.1
    refuses (UNIMPLEMENTED: No feasible span count ...). The other strategies' figures
    still print, rc 0. Three heads leave ulysses and usp out: two compiles, not four."""
    import json
    import subprocess
    import sys

    sets = ["model.layers=1", "model.d_model=384", "model.n_heads=3", "model.n_kv_heads=1",
            "model.d_ff=1024", "data.seq_len=12288", "data.batch_size=2", "mesh.context=4",
            "mesh.data=1"]
    command = [sys.executable, "-m", "lctrain.cli.main", "plan", "tiny", "--topology",
               "v5p:2x2x1", "--compile", "--json", *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "LCTRAIN_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["strategy"]: row for row in json.loads(done.stdout)["strategies"]}
    assert set(rows) == {"all_gather", "ring"}
    failed = rows.pop("all_gather")
    assert failed["compile_error"].startswith(("compiler aborted: Check failed: s_count",
                                               "compiler failed: UNIMPLEMENTED: No feasible"))
    assert failed["compiled_hbm_bytes_per_device"] is None
    assert rows and all(row["compiled_hbm_bytes_per_device"] > 0 for row in rows.values())
