"""Multi-process runs: one process per host (TPU VM pods) or several on one machine (CPU).

Must run before anything touches jax's devices. On TPU pods jax finds the coordinator
from the environment the TPU runtime sets; elsewhere the CLI passes it explicitly.
"""

from __future__ import annotations

import os

import jax

# Set by the TPU runtime on multi-host slices; their presence means "initialise from env".
TPU_POD_ENVIRONMENT = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None) -> None:
    if coordinator is None:
        if any(name in os.environ for name in TPU_POD_ENVIRONMENT):
            jax.distributed.initialize()
        return
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # CPU devices of different processes talk through gloo (TCP on this machine).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes,
                               process_id=process_id)
