"""Multi-process runs: one process per host (TPU VM pods) or several on one machine (CPU).

Must run before anything touches jax's devices. On TPU pods jax finds the coordinator
from the environment the TPU runtime sets; elsewhere the CLI passes it explicitly.
"""

from __future__ import annotations

import os

import jax


def several_tpu_hosts(environ=os.environ) -> bool:
    """Whether the TPU runtime's environment names more than one host: a multi-host slice
    (TPU_WORKER_HOSTNAMES lists every host, comma-separated) or several slices
    (MEGASCALE_COORDINATOR_ADDRESS). A single-host TPU VM lists one host and needs no
    coordinator; there jax.distributed.initialize() would only ask the cloud's metadata
    server for what it already knows (and fail where that server is unreachable)."""
    return "," in environ.get("TPU_WORKER_HOSTNAMES", "") or \
        "MEGASCALE_COORDINATOR_ADDRESS" in environ


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None) -> None:
    if coordinator is None:
        if several_tpu_hosts():
            jax.distributed.initialize()
        return
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # CPU devices of different processes talk through gloo (TCP on this machine).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes,
                               process_id=process_id)
