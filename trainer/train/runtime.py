"""Where jax will run, settled before it starts: fake CPU devices (runtime.cpu_devices),
the accelerator jax would find, the jaxlib release, and joining a multi-process run.

Imports no jax: XLA_FLAGS and JAX_PLATFORMS only count when set before jax is imported,
so the CLI, tests/conftest.py and the benchmarks call this first."""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
from pathlib import Path
from typing import Optional

# runtime.cpu_devices=auto on a machine without an accelerator.
AUTO_CPU_DEVICES = 8
# Device nodes the accelerator runtimes open, by the module through which jax drives them:
# libtpu opens /dev/accel0 (TPU v2-v4) or /dev/vfio/0 (v5e and later), CUDA /dev/nvidia0,
# ROCm /dev/kfd. Without the module jax runs on the CPU whatever the machine holds.
ACCELERATOR_NODES = {"libtpu": ("accel[0-9]*", "vfio/[0-9]*"),
                     "jax_cuda": ("nvidia[0-9]*",), "jax_rocm": ("kfd",)}


def start(cpu_devices: int | str, coordinator: Optional[str], num_processes: Optional[int],
          process_id: Optional[int]) -> None:
    """Sets up the devices (fake CPU ones if asked) and joins a multi-process run; the
    first thing a command does after reading its recipe, since it starts jax."""
    use_fake_cpu_devices(fake_cpu_device_count(cpu_devices))
    if not os.environ.get("JAX_PLATFORMS") and accelerator_module() is None:
        # jax would try an installed libtpu first and print a screen of warnings that it
        # finds no TPU before falling back to the CPU it ends up on anyway.
        os.environ["JAX_PLATFORMS"] = "cpu"
    from .distributed import initialize  # starts jax: only once the flags are set

    initialize(coordinator, num_processes, process_id)


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
