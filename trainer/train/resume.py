"""Rerunning in a used run dir: what may change between the run dir's recipe.yaml and the
recipe given now, checked before anything else.

Keys that only say how or where the same computation runs (mesh, strategy, kernels, remat,
checkpoints, logging, evaluation settings) may change: the checkpoint restores into any
sharding. train.steps may grow: the warmup stays, and the cosine decay is recomputed over
the new total, so the learning rate after the resume point follows the longer schedule.
Anything that alters the data or the state (model, data, the optimizer's settings, the
seed, the held-out split) must stay: such a run is a new stage (another run dir).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lctrain.recipes.coerce import build
from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.state.checkpoint import saved_steps

CHANGEABLE = ("train.steps", "model.init", "model.preset", "model.dtype", "mesh.",
              "parallel.", "attention.", "remat.", "optimizer.", "loss.", "checkpoint.",
              "runtime.", "eval.")
FIXED = ("eval.holdout",)  # under a changeable prefix, but it moves windows out of training


def check_rerun(recipe: Recipe, run_dir: Path) -> str | None:
    """RecipeError naming the keys when the new recipe changes the data or the state of the
    run in run_dir; else a note on a changed step count (None when nothing to say)."""
    path = run_dir / "recipe.yaml"
    # Without a checkpoint nothing of that recipe survives (a run that failed before its
    # first step, or was killed before its first save): the rerun starts at step 0.
    if not path.is_file() or not saved_steps(run_dir / "checkpoints"):
        return None
    # Read back through the schema, so keys added since the run began take their defaults.
    written = build(Recipe, yaml.safe_load(path.read_text()) or {}, prefix="")
    before = _flat(yaml.safe_load(yaml.safe_dump(written.to_dict())))
    now = _flat(yaml.safe_load(yaml.safe_dump(recipe.to_dict())))
    changed = sorted(key for key in set(before) | set(now)
                     if before.get(key) != now.get(key) and not _changeable(key))
    if changed:
        pairs = "; ".join(f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in changed)
        raise RecipeError(f"run dir {run_dir} was trained with another recipe: {pairs}. "
                          f"These change the data or the model state, so the run cannot "
                          f"resume; keep them, or use another --run-dir")
    steps = before.get("train.steps")
    if steps is not None and steps != recipe.train.steps:
        return (f"train.steps {steps} -> {recipe.train.steps}: the cosine decay now runs over "
                f"{recipe.train.steps} steps from the resume point on")
    return None


def _changeable(key: str) -> bool:
    return key not in FIXED and key.startswith(CHANGEABLE)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
