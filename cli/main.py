"""`lctrain` commands. Kept thin: parse arguments, load the recipe, hand over.

jax is imported only after the recipe is read, because `runtime.cpu_devices` must reach
XLA_FLAGS before jax initialises its backends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from lctrain.recipes import RecipeError, load_recipe
from lctrain.trainer.data import DataError  # numpy only: safe before jax is configured

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Long-context language-model training with context parallelism.")
console = Console()
error_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr; exit 2 for bad input (nothing was compiled), 1 for a failed run."""
    error_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=code)


def use_fake_cpu_devices(count: int) -> None:
    """Fake devices are CPU devices: pin the platform too, so an installed libtpu (used for
    ahead-of-time TPU compiles) does not go looking for a TPU first."""
    if count > 0:
        flag = f"--xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def default_run_dir(recipe_path: Optional[str]) -> Path:
    name = Path(recipe_path).stem if recipe_path else "tiny"
    return Path("runs") / name


@app.callback()
def main() -> None:
    """Long-context language-model training with context parallelism."""


@app.command()
def run(
    recipe: Optional[str] = typer.Argument(
        None, help="Recipe YAML file or built-in recipe name (default: the built-in 'tiny')."),
    set_: list[str] = typer.Option([], "--set", help="Override a recipe key: section.key=value."),
    steps: Optional[int] = typer.Option(None, help="Shorthand for --set train.steps=N."),
    run_dir: Optional[Path] = typer.Option(
        None, help="Checkpoints, metrics and TensorBoard events (default: runs/<recipe name>). "
                   "A run dir with checkpoints is resumed."),
    coordinator: Optional[str] = typer.Option(
        None, envvar="LCTRAIN_COORDINATOR",
        help="host:port of process 0 for a multi-process run (TPU pods find it themselves)."),
    num_processes: Optional[int] = typer.Option(None, envvar="LCTRAIN_NUM_PROCESSES",
                                                help="Processes in a multi-process run."),
    process_id: Optional[int] = typer.Option(None, envvar="LCTRAIN_PROCESS_ID",
                                             help="This process's index, 0-based."),
) -> None:
    """Train a model from a recipe, resuming from the run dir's latest checkpoint."""
    overrides = list(set_) + ([f"train.steps={steps}"] if steps is not None else [])
    try:
        loaded = load_recipe(recipe, overrides)
    except RecipeError as err:
        fail(str(err))
    use_fake_cpu_devices(loaded.runtime.cpu_devices)
    from lctrain.trainer.distributed import initialize
    from lctrain.trainer.loop import NonFiniteLoss, train

    initialize(coordinator, num_processes, process_id)
    try:
        train(loaded, run_dir or default_run_dir(recipe), console)
    except (RecipeError, DataError) as err:
        fail(str(err))
    except NonFiniteLoss as err:
        fail(str(err), code=1)


if __name__ == "__main__":
    app()
