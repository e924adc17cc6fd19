"""Phase 2 of a recipe's checks for `lctrain run`: the recipe against the files it names
(data, and the tokenizer a retrieval eval samples from), the run dir, the run it starts
from and the devices, in that order, before anything is built or compiled. Every failure
is a RecipeError naming the key, file or option, which the CLI prints as one line with
exit 2.

Phase 1 (recipes.load_recipe) checked what the recipe says on its own, without jax. The
checks that belong to one concern stay with it (the data's in trainer/data/checks.py, a
strategy's in its file, a rerun's in resume.py, a stage's in init_from.py); this is the one
place that runs them all for a run. `lctrain eval` and `export` run the parts they need:
the data check in the CLI, the retrieval check in evaluate, the device checks in mesh_for.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from rich.console import Console

from lctrain.recipes import Recipe
from lctrain.trainer.data.checks import check_data
from lctrain.trainer.data.provenance import (PlannedRecord, check_against_record, plan_record,
                                             read_record)
from lctrain.trainer.evaluation.ruler import check_eval_task
from lctrain.trainer.state.checkpoint import saved_steps
from lctrain.trainer.state.device_checks import DevicePlan, check_devices
from lctrain.trainer.train.init_from import InitFrom, checked_init_from
from lctrain.trainer.train.resume import check_rerun


class RunPlan(NamedTuple):
    """What the checks of a run found."""
    devices: DevicePlan
    init_from: InitFrom | None  # its step resolved; None when the run dir resumes
    rerun_note: str | None  # what changed since the run dir's recipe, when it may
    tokenizer_record: PlannedRecord | None  # what a fresh run dir records; None on a resume


def check_run(recipe: Recipe, run_dir: Path, devices=None, init_from: InitFrom | None = None,
              console: Console | None = None) -> RunPlan:
    """RecipeError unless `recipe` can train in `run_dir` on `devices` (default: all)."""
    check_data(recipe)
    if recipe.eval.every:
        check_eval_task(recipe)
    rerun_note = check_rerun(recipe, run_dir)
    tokenizer_record = _tokenizer_record(recipe, run_dir)
    init_from = checked_init_from(init_from, recipe, run_dir, console)
    return RunPlan(check_devices(recipe, devices, console), init_from, rerun_note,
                   tokenizer_record)


def _tokenizer_record(recipe: Recipe, run_dir: Path) -> PlannedRecord | None:
    """A resumed run reads data of the tokenizer it trained with (a run dir from before
    records were kept is taken as it is); a fresh one plans its record."""
    if saved_steps(run_dir / "checkpoints"):
        if read_record(run_dir) is not None:
            check_against_record(recipe.data, run_dir, "data")
        return None
    return plan_record(recipe)
