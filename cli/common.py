"""What every `lctrain` command shares: the Typer app, the consoles, one-line failures and
the fake-device switch. Imports neither jax nor the trainer."""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
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


def start(cpu_devices: int | str, coordinator: Optional[str], num_processes: Optional[int],
          process_id: Optional[int]) -> None:
    """Sets up the devices (fake CPU ones if asked) and joins a multi-process run; the
    first thing a command does after reading its recipe, since it starts jax."""
    use_fake_cpu_devices(fake_cpu_device_count(cpu_devices))
    if not os.environ.get("JAX_PLATFORMS") and accelerator_module() is None:
        # jax would try an installed libtpu first and print a screen of warnings that it
        # finds no TPU before falling back to the CPU it ends up on anyway.
        os.environ["JAX_PLATFORMS"] = "cpu"
    from lctrain.trainer.train.distributed import initialize

    initialize(coordinator, num_processes, process_id)


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


# runtime.cpu_devices=auto on a machine without an accelerator.
AUTO_CPU_DEVICES = 8
# Device nodes the accelerator runtimes open, by the module through which jax drives them:
# libtpu opens /dev/accel0 (TPU v2-v4) or /dev/vfio/0 (v5e and later), CUDA /dev/nvidia0,
# ROCm /dev/kfd. Without the module jax runs on the CPU whatever the machine holds.
ACCELERATOR_NODES = {"libtpu": ("accel[0-9]*", "vfio/[0-9]*"),
                     "jax_cuda": ("nvidia[0-9]*",), "jax_rocm": ("kfd",)}


def fake_cpu_device_count(setting: int | str) -> int:
    """runtime.cpu_devices as a count. 'auto' is AUTO_CPU_DEVICES unless jax will find an
    accelerator, decided without importing jax (XLA_FLAGS must be set before it starts);
    JAX_PLATFORMS, when the user set it, decides instead."""
    if setting != "auto":
        return setting
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return AUTO_CPU_DEVICES if platforms.split(",")[0] == "cpu" else 0
    return 0 if accelerator_module() else AUTO_CPU_DEVICES


def accelerator_module(dev: Path = Path("/dev"),
                       installed: Optional[set[str]] = None) -> Optional[str]:
    """The installed module (libtpu, jax_cuda*, jax_rocm*) whose device nodes are under
    `dev`, or None when jax will run on the CPU."""
    if installed is None:
        installed = {module.name for module in pkgutil.iter_modules()}
    for prefix, patterns in ACCELERATOR_NODES.items():
        if (any(name.startswith(prefix) for name in installed)
                and any(next(dev.glob(pattern), None) for pattern in patterns)):
            return prefix
    return None


def fake_cpu_device_flags(count: int) -> str:
    """XLA_FLAGS for `count` CPU devices in one process.

    jax lowers every collective of a shard_map with one channel id, and XLA:CPU meets the
    devices of a collective by that id, so two independent collectives that one device
    starts in a different order from another can meet the wrong partner
    (tests/test_cpu_collectives.py). Which scheduler keeps them apart depends on the jax
    release: on jax 0.12 the concurrency-optimized one let the ring on data 2 x context 4
    under full remat give gradients off by 0.04-0.33 (or NaN) from call to call, and off
    they match the single device to 1e-8; on jax 0.10 turning it off is what breaks the
    ring (wrong results or a rendezvous abort, 3 runs in 4), so there it stays on."""
    flags = f"--xla_force_host_platform_device_count={count}"
    if jaxlib_at_least(0, 12):
        flags += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
    return flags


def jaxlib_at_least(major: int, minor: int) -> bool:
    """Whether the installed jaxlib is this release or later, read from its metadata
    (jax-free: XLA_FLAGS must be set before jax is imported)."""
    release = importlib.metadata.version("jaxlib").split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


def use_fake_cpu_devices(count: int) -> None:
    """Fake devices are CPU devices: pin the platform too, so an installed libtpu (used for
    ahead-of-time TPU compiles) does not go looking for a TPU first."""
    if count > 0:
        flags = fake_cpu_device_flags(count)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def default_run_dir(recipe_path: Optional[str]) -> Path:
    name = Path(recipe_path).stem if recipe_path else DEFAULT_RECIPE
    return Path("runs") / name
