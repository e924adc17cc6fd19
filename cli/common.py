"""What every `lctrain` command shares: the Typer app, the consoles, one-line failures and
the fake-device switch. Imports neither jax nor the trainer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Long-context language-model training with context parallelism.")
console = Console()
error_console = Console(stderr=True)


# Options several commands share.
SETS = typer.Option([], "--set", help="Override a recipe key: section.key=value.")
COORDINATOR = typer.Option(
    None, envvar="LCTRAIN_COORDINATOR",
    help="host:port of process 0 for a multi-process run (TPU pods find it themselves).")
NUM_PROCESSES = typer.Option(None, envvar="LCTRAIN_NUM_PROCESSES",
                             help="Processes in a multi-process run.")
PROCESS_ID = typer.Option(None, envvar="LCTRAIN_PROCESS_ID",
                          help="This process's index, 0-based.")


def start(cpu_devices: int, coordinator: Optional[str], num_processes: Optional[int],
          process_id: Optional[int]) -> None:
    """Sets up the devices (fake CPU ones if asked) and joins a multi-process run; the
    first thing a command does after reading its recipe, since it starts jax."""
    use_fake_cpu_devices(cpu_devices)
    from lctrain.trainer.distributed import initialize

    initialize(coordinator, num_processes, process_id)


def attempt(action: Callable[[], T]) -> T:
    """action(), with the errors a user can cause (a bad recipe, bad data) turned into one
    line and exit 2."""
    from lctrain.recipes import RecipeError
    from lctrain.trainer.data import DataError  # numpy only: safe before jax starts

    try:
        return action()
    except (RecipeError, DataError) as err:
        fail(str(err))


def fail(message: str, code: int = 2) -> None:
    """One line on stderr; exit 2 for bad input (nothing was compiled), 1 for a failed run."""
    # Escaped: keys, paths and extras (".[tpu]") contain square brackets, rich's markup.
    error_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False,
                        soft_wrap=True)
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
