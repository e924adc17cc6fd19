"""The run compiles its train step once, before the first step, prints XLA's per-device
figure, and (parallel.strategy=auto) falls back to the planner's next strategy when that
figure does not fit in device memory."""

import dataclasses
import io
import logging

import jax
import pytest
from rich.console import Console

from lctrain.parallel.auto import CompiledNeed, first_that_fits, none_fits, refused_need
from lctrain.parallel.chips import gigabytes
from lctrain.recipes import load_recipe
from lctrain.trainer.outputs.failures import DoesNotFit, explain, out_of_device_memory
from lctrain.trainer.state import build
from lctrain.trainer.train import loop

# Two devices, one layer, 128 tokens: a compile takes seconds on CPU. Auto's ranking is
# all_gather, ulysses, ring; which of the last two needs less than all_gather on CPU depends
# on XLA:CPU's schedule, which differs between jax releases
# (trainer/train/runtime.fake_cpu_device_flags), so the test takes the first of them that fits.
SMALL = ["parallel.strategy=auto", "mesh.context=2", "mesh.data=1", "data.seq_len=128",
         "data.batch_size=1", "model.layers=1", "train.steps=1", "train.warmup_steps=1",
         "checkpoint.every=0"]


def recorded() -> Console:
    return Console(file=io.StringIO(), width=400)


def memory_analysis_bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The train steps XLA compiles, by jax's compile log (every path: AOT or first call)."""
    names = []

    class Counter(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of jit(train_step)"):
                names.append(message)

    handler = Counter(level=logging.WARNING)
    logger = logging.getLogger("jax._src.dispatch")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    yield names
    jax.config.update("jax_log_compiles", False)
    logger.removeHandler(handler)


def test_auto_skips_a_strategy_whose_compiled_step_does_not_fit(tmp_path, compiles,
                                                                  monkeypatch):
    """A limit under the first choice's figure compiles the next; under every one, the run
    stops out of device memory."""
    devices = jax.devices()[:2]
    executables = []

    def spy(name, compiled, platform):
        executables.append(compiled)
        return real_need(name, compiled, platform)

    real_need = build.compiled_need
    monkeypatch.setattr(build, "compiled_need", spy)
    # No limit on CPU: a run compiles its first choice once (not again at the first step)
    # and prints the executable's own figure.
    console = recorded()
    loop.train(load_recipe("tiny", SMALL), tmp_path / "first", console, devices)
    first_need = memory_analysis_bytes(executables[0])
    printed = console.file.getvalue()
    ranking = ["all_gather", "ulysses", "ring"]
    assert len(compiles) == 1 and "step 1/1 | loss" in printed
    assert (f"compiled train step: {ranking[0]}, {gigabytes(first_need)} per device in "
            in printed)

    # A limit just under that figure: the first choice is skipped, the next one compiled.
    compiles.clear()
    limit = first_need - 1
    console = recorded()
    recipe = load_recipe("tiny", SMALL)
    run = build.compile_run(recipe, devices, console, memory_limit=limit)
    printed = "\n".join(run.report)
    chosen = run.strategy.name
    assert run.recipe.parallel.strategy == chosen and chosen in ranking[1:]
    needs = [memory_analysis_bytes(executable) for executable in executables[1:]]
    assert len(compiles) == len(needs) == ranking.index(chosen) + 1 and needs[0] == first_need
    assert run.train_step is executables[-1]
    assert needs[-1] <= limit < first_need and all(need > limit for need in needs[:-1])
    assert (f"{ranking[0]} needs {gigabytes(first_need)} of {gigabytes(limit)} per device; "
            f"trying {ranking[1]}") in printed
    assert (f"compiled train step: {chosen}, {gigabytes(needs[-1])} per device "
            f"(of {gigabytes(limit)}) in ") in printed

    # Every compiled step over the limit (no refusal from XLA): out of device memory, naming
    # the smallest need (this once raised AttributeError on the TPU: benchmarks/step.py).
    # The same programs as above, in the same process: here, not in a test of its own that
    # compiled all three again.
    with pytest.raises(DoesNotFit) as err:
        build.compile_run(recipe, devices, recorded(), memory_limit=1)
    message, code = explain(err.value)
    assert code == 1 and message.startswith("out of device memory: ")
    assert " needs " in message and "(the least of all_gather, ulysses, ring)" in message


def test_each_candidate_compiles_once_until_one_fits():
    tried, lines = [], []

    def compile_candidate(strategy, ulysses):
        tried.append(strategy)
        need = {"all_gather": 97_200_000_000, "ulysses": 96_000_000_000,
                "usp": 61_300_000_000}[strategy]
        return f"executable of {strategy}", CompiledNeed(strategy if strategy != "usp"
                                                          else "usp (ulysses 2)", need)

    candidates = [("all_gather", 1), ("ulysses", 1), ("usp", 2), ("ring", 1)]
    found = first_that_fits(candidates, compile_candidate, 95_700_000_000, lines.append)
    assert found[0] == "executable of usp" and tried == ["all_gather", "ulysses", "usp"]
    assert lines == ["all_gather needs 97.20 GB of 95.70 GB per device; trying ulysses",
                     "ulysses needs 96.00 GB of 95.70 GB per device; trying usp (ulysses 2)",
                     "compiled train step: usp (ulysses 2), 61.30 GB per device (of 95.70 GB)"]


def test_when_none_fits_the_failure_names_the_smallest_need():
    needs = [CompiledNeed("all_gather", 99_000_000_000),
             refused_need("ring", "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. "
                                  "Used 97.24G of 95.74G hbm. Exceeded hbm capacity by 1.50G."),
             CompiledNeed("usp (ulysses 2)", 98_000_000_000)]
    assert needs[1].hbm_bytes == round(97.24 * 2**30) and "Used 97.24G" in needs[1].refused
    newer = refused_need("ring", "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                                 "required for HLO temporaries (97.06G) exceeds available HBM "
                                 "(95.74G).")
    assert newer.hbm_bytes == round(97.06 * 2**30)
    found = first_that_fits([("all_gather", 1), ("ring", 1), ("usp", 2)],
                            lambda s, u: (None, needs[["all_gather", "ring", "usp"].index(s)]),
                            95_700_000_000, lambda line: None)
    assert found == needs
    message, code = explain(DoesNotFit(out_of_device_memory(none_fits(found, 95_700_000_000))))
    assert code == 1
    assert message.startswith("out of device memory: usp (ulysses 2) needs 98.00 GB of 95.70 GB "
                              "per device (the least of all_gather, ring, usp (ulysses 2))")


def test_fallbacks_follow_the_recommendation_on_what_is_left():
    """The ranking is recommend()'s pick, then its pick of the rest: with a memory where
    only some strategies fit by the estimate, those come first, fastest first."""
    from lctrain.parallel import planner
    from lctrain.parallel.auto import ranked
    from lctrain.parallel.chips import CHIPS, LOAD_RESERVE_BYTES
    from lctrain.parallel.planner.calibration import peak_share

    # With the MLP in chunks each strategy's attention sets its peak.
    recipe = load_recipe("tiny", ["model.preset=llama3.1-8b", "data.seq_len=229376",
                                "data.batch_size=1", "mesh.data=1", "mesh.context=4",
                                "parallel.strategy=auto", "remat.mlp_chunk_tokens=16384"])
    sizes = {"data": 1, "fsdp": 1, "context": 4, "tensor": 1}
    # ulysses's and all_gather's estimates (99.4, 102.0 GB) fit an HBM that holds the
    # attention phase's peak share of a figure between all_gather's and ring's beside the
    # load reserve, ring's and usp's (103.4: a ring's working set peaks highest with the
    # MLP in chunks) do not
    estimates = {p.strategy: p.hbm_bytes
                 for p in planner.plan(recipe, CHIPS["v5p"], sizes, "tpu").plans}
    between = (estimates["all_gather"] + estimates["ring"]) / 2
    hbm = LOAD_RESERVE_BYTES + peak_share("layer_attention") * between
    chip = dataclasses.replace(CHIPS["v5p"], hbm_bytes=hbm)
    result = planner.plan(recipe, chip, sizes, "tpu")
    order = ranked(result.plans)
    assert order[0] is result.choice and sorted(map(id, order)) == sorted(map(id, result.plans))
    for index in range(len(order)):
        assert order[index] is planner.recommend(order[index:])[0]
    assert [p.fits for p in order] == [True, True, False, False]
    assert {p.strategy for p in order[2:]} == {"ring", "usp"}
