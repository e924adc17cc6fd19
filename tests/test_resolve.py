"""Resolve once (#49): a run resolves its recipe without writing into it. compile_run
leaves the recipe it is given as it is (parallel.strategy=auto stays auto) and returns the
one that trained (CompiledRun.recipe: auto's choice), which the run dir records; the device
checks run once per compile candidate."""

import io

import jax
import pytest
import yaml
from rich.console import Console

from lctrain.recipes import load_recipe
from lctrain.trainer.outputs.failures import DoesNotFit
from lctrain.trainer.state import build, device_checks
from lctrain.trainer.train import loop

# test_auto_fit's tiny auto run: two devices, one layer, 128 tokens (seconds on CPU).
SMALL = ["parallel.strategy=auto", "mesh.context=2", "mesh.data=1", "data.seq_len=128",
         "data.batch_size=1", "model.layers=1", "train.steps=1", "train.warmup_steps=1",
         "checkpoint.every=0"]
RANKING = {"all_gather", "ulysses", "ring"}


@pytest.fixture
def checked(monkeypatch) -> list:
    """The strategy of every recipe the device checks ran on (each run of check_devices
    checks its strategies once)."""
    strategies, real = [], device_checks._check_strategies

    def counted(recipe, *args):
        strategies.append(recipe.parallel.strategy)
        return real(recipe, *args)

    monkeypatch.setattr(device_checks, "_check_strategies", counted)
    return strategies


def test_compile_run_leaves_an_auto_recipe_as_it_is_and_returns_the_one_it_chose(checked):
    recipe = load_recipe("tiny", SMALL)
    run = build.compile_run(recipe, jax.devices()[:2])
    assert recipe == load_recipe("tiny", SMALL) and recipe.parallel.strategy == "auto"
    assert run.recipe.parallel.strategy == run.strategy.name in RANKING
    # Checked once, in compile_run; building the candidate the checks chose reuses them.
    assert checked == [run.strategy.name]


def test_a_run_checks_its_devices_once_and_records_the_strategy_it_chose(tmp_path, checked):
    recipe = load_recipe("tiny", SMALL)
    loop.train(recipe, tmp_path, Console(file=io.StringIO()), jax.devices()[:2])
    saved = yaml.safe_load((tmp_path / "recipe.yaml").read_text())["parallel"]["strategy"]
    assert recipe.parallel.strategy == "auto" and saved in RANKING
    assert checked == [saved]   # in preflight only, not again when compiling


def test_every_candidate_is_checked_once(checked):
    """None fits: each of auto's three candidates compiled, each checked once."""
    recipe = load_recipe("tiny", SMALL)
    with pytest.raises(DoesNotFit):
        build.compile_run(recipe, jax.devices()[:2], memory_limit=1)
    assert sorted(checked) == sorted(RANKING) and recipe.parallel.strategy == "auto"
