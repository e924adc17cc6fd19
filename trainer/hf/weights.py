"""Where a forward-only command (export, eval) takes its weights from: a run dir's
checkpoint (the latest, or a given step), else the recipe's model.init. Only the
parameters are read, never the optimizer state."""

from __future__ import annotations

from pathlib import Path

from lctrain.recipes.schema import Recipe, RecipeError
from lctrain.trainer.hf.convert import load_params
from lctrain.trainer.outputs.progress import timed
from lctrain.trainer.state.checkpoint import Checkpointer
from lctrain.trainer.state.step import Trainable, TrainState


def load_weights(recipe: Recipe, trainable: Trainable, run_dir: Path | None,
                 step: int | None = None, console=None) -> tuple[dict, str]:
    """(parameters in the trainable's shardings, where they came from); progress on
    `console`."""
    abstract = trainable.abstract_state.params
    checkpoints = Path(run_dir) / "checkpoints" if run_dir else None
    if checkpoints and checkpoints.is_dir():
        checkpointer = Checkpointer(checkpoints, recipe.checkpoint)
        try:
            saved = checkpointer.manager.all_steps()
            if saved:
                chosen = max(saved) if step is None else step
                if chosen not in saved:
                    raise RecipeError(f"--step {step}: {checkpoints} has no such checkpoint; "
                                      f"saved steps: {', '.join(map(str, sorted(saved)))}")
                with timed(console, f"loaded checkpoint {run_dir} step {chosen}"):
                    params = checkpointer.restore_params(abstract, chosen)
                return params, f"{run_dir} step {chosen}"
        finally:
            checkpointer.close()
    if step is not None:
        raise RecipeError(f"--step {step}: {run_dir} has no checkpoints; train it first "
                          f"(lctrain run) or drop --step")
    if recipe.model.hf_dir is None:
        raise RecipeError(f"no weights: {run_dir} has no checkpoint and model.init is "
                          f"'random'; train first (lctrain run), give --run-dir, or set "
                          f"model.init=hf:<dir>")
    return (load_params(recipe.model, trainable.state_shardings.params, abstract, console),
            recipe.model.init)


def initial_state(recipe: Recipe, trainable: Trainable, console=None) -> TrainState:
    """Step 0: random parameters, or model.init's Hugging Face weights read straight into
    their shards; the optimizer starts fresh either way."""
    if recipe.model.hf_dir is None:
        return trainable.init()
    params = load_params(recipe.model, trainable.state_shardings.params,
                         trainable.abstract_state.params, console)
    return trainable.start_from(params)
