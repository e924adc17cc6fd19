"""Stages: `lctrain run STAGE2.yaml --init-from RUN_DIR[:STEP]` starts a new run from another
run's checkpoint (its latest, or STEP).

A stage is a new run: its own run dir, step 0, its own learning-rate schedule, and its data
from batch 0. The parameters come over, restored straight into the new run's shardings, so
sequence length, batch, mesh and strategy may all change; with --init-optimizer AdamW's
moments (and the count their bias correction uses) come too. Everything is checked against
the checkpoint's metadata before anything compiles. The load happens once, at the start:
a run dir that already has checkpoints resumes from its own and ignores --init-from (as
TorchTitan and MaxText do). The stage's run dir records where it started (init_from.json).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import optax
import yaml
from flax import nnx

from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.model.transformer import Transformer
from lctrain.trainer.outputs.progress import timed
from lctrain.trainer.state.checkpoint import Checkpointer, saved_steps
from lctrain.trainer.state.optimizer import make_optimizer
from lctrain.trainer.state.step import Trainable, TrainState

LINEAGE_FILE = "init_from.json"


@dataclasses.dataclass(frozen=True)
class InitFrom:
    run_dir: Path
    step: int | None = None  # None: the latest checkpoint
    optimizer: bool = False  # the optimizer state too (--init-optimizer)

    @classmethod
    def parse(cls, text: str, optimizer: bool = False) -> InitFrom:
        """RUN_DIR or RUN_DIR:STEP."""
        path, colon, tail = text.rpartition(":")
        if colon and tail.isdigit():
            return cls(Path(path), int(tail), optimizer)
        return cls(Path(text), None, optimizer)

    def __str__(self) -> str:
        return str(self.run_dir) + ("" if self.step is None else f":{self.step}")


def checked_init_from(init: InitFrom | None, recipe: Recipe, run_dir: Path,
                      console) -> InitFrom | None:
    """`init` with its step resolved, once its checkpoint fits the recipe (RecipeError
    otherwise); None, said in one line, when run_dir has checkpoints of its own to resume."""
    if init is None:
        _check_stage_without_init(run_dir)
        return None
    own = saved_steps(run_dir / "checkpoints")
    if own:
        console.print(f"--init-from {init} ignored: run dir {run_dir} has its own checkpoints "
                      f"and resumes from step {own[-1]}", markup=False, soft_wrap=True)
        return None
    chosen = dataclasses.replace(init, step=_chosen_step(init))
    checkpointer = Checkpointer(init.run_dir / "checkpoints", recipe.checkpoint)
    try:
        saved = checkpointer.saved_shapes(chosen.step)
    finally:
        checkpointer.close()
    params = _abstract_params(recipe)
    _check_parameters(chosen, _shapes(saved["params"]), _shapes(params), recipe)
    if init.optimizer:
        _check_optimizer(chosen, _shapes(saved["opt_state"]), params, recipe)
    return chosen


def _check_stage_without_init(run_dir: Path) -> None:
    """A stage's run dir with no checkpoint yet needs its --init-from again: trained from
    random weights, it would contradict the start it records."""
    lineage = run_dir / LINEAGE_FILE
    if not lineage.is_file() or saved_steps(run_dir / "checkpoints"):
        return
    start = json.loads(lineage.read_text())
    raise RecipeError(f"run dir {run_dir} is a stage started from {start['run_dir']} step "
                      f"{start['step']} ({LINEAGE_FILE}) and has no checkpoint of its own "
                      f"yet; give --init-from {start['run_dir']}:{start['step']} again, or "
                      f"use another --run-dir")


def _chosen_step(init: InitFrom) -> int:
    saved = saved_steps(init.run_dir / "checkpoints")
    if not saved:
        why = ("has no checkpoint yet; train it first (lctrain run)"
               if (init.run_dir / "recipe.yaml").is_file() else
               "is not a run dir (no recipe.yaml); give the --run-dir of the earlier stage")
        raise RecipeError(f"--init-from {init}: {init.run_dir} {why}")
    if init.step is None:
        return saved[-1]
    if init.step not in saved:
        raise RecipeError(f"--init-from {init}: {init.run_dir} has no checkpoint at step "
                          f"{init.step}; saved steps: {', '.join(map(str, saved))}")
    return init.step


def _abstract_params(recipe: Recipe) -> dict:
    model = nnx.eval_shape(lambda: Transformer(recipe.model, nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """{'layers.attention.wq': shape, ...} of a tree of arrays, shape structs or orbax's
    metadata, whose tuples orbax saves as lists and empty states as None."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(_key_name(key) for key in path): tuple(leaf.shape) for path, leaf in leaves}


def _key_name(key) -> str:
    for attribute in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _check_parameters(init: InitFrom, saved: dict, ours: dict, recipe: Recipe) -> None:
    difference = _first_difference(saved, ours)
    if difference is None:
        return
    changed = _changed_keys(init, "model", recipe.to_dict()["model"], ignore=("init",))
    raise RecipeError(f"--init-from {init}: {difference}{changed}; a stage keeps the model "
                      f"of the run it starts from: set the model keys as in "
                      f"{init.run_dir / 'recipe.yaml'}")


def _first_difference(saved: dict, ours: dict) -> str | None:
    for name, shape in ours.items():
        if name not in saved:
            return f"parameter {name} {shape} is not in the checkpoint"
        if saved[name] != shape:
            return f"parameter {name} is {saved[name]} there and {shape} in this recipe"
    extra = [name for name in saved if name not in ours]
    return f"the checkpoint's parameter {extra[0]} is not in this recipe's model" if extra else None


def _check_optimizer(init: InitFrom, saved: dict, params: dict, recipe: Recipe) -> None:
    """The optimizer state's tree (which the train settings shape: clipping adds a state,
    on_nonfinite=skip wraps it) must be the one this recipe's optimizer builds."""
    def fits(train) -> bool:
        return _shapes(jax.eval_shape(make_optimizer(train).init, params)) == saved

    if fits(recipe.train):
        return
    before = _recipe_section(init, "train")
    culprits = [key for key, value in before.items()
                if hasattr(recipe.train, key) and getattr(recipe.train, key) != value
                and fits(dataclasses.replace(recipe.train, **{key: value}))]
    changed = "; ".join(f"train.{key} {before[key]!r} -> {getattr(recipe.train, key)!r}"
                        for key in culprits) or "the optimizer settings changed"
    raise RecipeError(f"--init-from {init} --init-optimizer: its optimizer state does not fit "
                      f"this recipe's optimizer ({changed}); keep those settings, or drop "
                      f"--init-optimizer to start with a fresh AdamW state")


def _recipe_section(init: InitFrom, section: str) -> dict:
    """A section of the earlier stage's recipe.yaml (empty where there is none)."""
    path = init.run_dir / "recipe.yaml"
    raw = yaml.safe_load(path.read_text()) if path.is_file() else None
    return (raw or {}).get(section) or {}


def _changed_keys(init: InitFrom, section: str, now: dict, ignore=()) -> str:
    """' (model.layers 2 -> 4; ...)': the section's keys this recipe changed."""
    before = _recipe_section(init, section)
    pairs = [f"{section}.{key} {before.get(key)!r} -> {now.get(key)!r}"
             for key in sorted(set(before) | set(now))
             if key not in ignore and before.get(key) != now.get(key)]
    return f" ({'; '.join(pairs)})" if pairs else ""


def stage_start(init: InitFrom, recipe: Recipe, trainable: Trainable, run_dir: Path,
                console) -> tuple[TrainState, int]:
    """The stage's first state, read into the trainable's shardings, and its first data batch
    (0); records the lineage in run_dir."""
    checkpointer = Checkpointer(init.run_dir / "checkpoints", recipe.checkpoint)
    what = "parameters and optimizer state" if init.optimizer else "parameters"
    try:
        with timed(console, f"started from {init.run_dir} step {init.step} ({what})"):
            if init.optimizer:
                restored, _ = checkpointer.restore(trainable.abstract_state, init.step)
                state = TrainState(_zero_like(restored.step), restored.params,
                                   _restart_schedules(restored.opt_state))
            else:
                state = trainable.start_from(
                    checkpointer.restore_params(trainable.abstract_state.params, init.step))
    finally:
        checkpointer.close()
    unread = f"; model.init {recipe.model.init} not read" if recipe.model.hf_dir else ""
    console.print(f"a new stage: step, data and learning-rate schedule start at 0{unread}",
                  markup=False, soft_wrap=True)
    if jax.process_index() == 0:
        (run_dir / LINEAGE_FILE).write_text(json.dumps(
            {"run_dir": str(init.run_dir.absolute()), "step": init.step,
             "optimizer_state": init.optimizer}, indent=1) + "\n")
    return state, 0


def _restart_schedules(opt_state):
    """The optimizer state with each learning-rate schedule's count back at 0, so the stage
    follows its own schedule from its step 0 (as its logged lr says); Adam keeps its moments
    and the count of their bias correction."""
    def restart(node):
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=_zero_like(node.count))
        return node

    return jax.tree.map(restart, opt_state,
                        is_leaf=lambda node: isinstance(node, optax.ScaleByScheduleState))


def _zero_like(array: jax.Array) -> jax.Array:
    return jax.device_put(np.zeros(array.shape, array.dtype), array.sharding)
