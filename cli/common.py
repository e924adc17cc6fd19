"""What every `lctrain` command shares: the Typer app, the consoles, the shared options and
one-line failures. Imports neither jax nor the trainer."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Callable, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperOption

from lctrain.recipes.loader import DEFAULT_RECIPE

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Long-context language-model training with context parallelism.")


def _value_type(option: TyperOption, ctx) -> str | None:
    """The type column of --help: nothing for a flag, which takes no value (typer 0.29
    writes <bool> after every flag, --help's own included)."""
    return None if option.is_flag else _typer_value_type(option, ctx)


_typer_value_type = TyperOption.display_type_rich
TyperOption.display_type_rich = _value_type
console = Console()
error_console = Console(stderr=True)


class DEBUG:
    """`lctrain --debug`: tracebacks for expected failures too."""
    enabled = False


# Options several commands share.
SETS = typer.Option([], "--set", metavar="KEY=VALUE",
                    help="Override a recipe key: section.key=value (repeatable).")
COORDINATOR = typer.Option(
    None, envvar="LCTRAIN_COORDINATOR",
    help="host:port of process 0 for a multi-process run (TPU pods find it themselves).")
NUM_PROCESSES = typer.Option(None, envvar="LCTRAIN_NUM_PROCESSES",
                             help="Processes in a multi-process run.")
PROCESS_ID = typer.Option(None, envvar="LCTRAIN_PROCESS_ID",
                          help="This process's index, 0-based.")


# What `lctrain --version` reports: lctrain and the toolchain that decides what it compiles.
VERSIONED = ("lctrain", "jax", "jaxlib", "libtpu")


def versions_line() -> str:
    """'lctrain 0.1.0, jax 0.10.2, ...', read from the installed packages' metadata (no
    import of jax: it would start looking for devices)."""
    found = []
    for name in VERSIONED:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def attempt(action: Callable[[], T]) -> T:
    """action(), with the failures a user can act on (a bad recipe or data, out of memory,
    an unreadable checkpoint or file) turned into one line and exit 2 or 1; a bug keeps its
    traceback, and with --debug every failure does."""
    from lctrain.trainer.outputs.failures import explain  # jax-free: safe before jax starts

    try:
        return action()
    except Exception as err:
        explained = explain(err)
        if explained is None or DEBUG.enabled:
            raise
        fail(*explained)


def wide_console() -> Console:
    """The console for tables meant to be read whole: in a pipe or a file rich would fold
    them to 80 columns."""
    return console if console.is_terminal else Console(width=160)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr; exit 2 for bad input (nothing was compiled), 1 for a failed run."""
    # Escaped: keys, paths and extras (".[tpu]") contain square brackets, rich's markup.
    error_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False,
                        soft_wrap=True)
    raise typer.Exit(code=code)


def default_run_dir(recipe_path: Optional[str]) -> Path:
    name = Path(recipe_path).stem if recipe_path else DEFAULT_RECIPE
    return Path("runs") / name
