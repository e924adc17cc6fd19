"""Environment for tests that start lctrain in subprocesses."""

import os
import tempfile

# One persistent compilation cache for the subprocesses of a test process: a restart (after
# a kill, to resume, as a second process) loads the executables an earlier start compiled,
# as a user's cache would, instead of paying the compile again. A truncated entry (a kill
# mid-write) is only a warning to JAX, which then compiles.
COMPILE_CACHE = tempfile.mkdtemp(prefix="lctrain-test-jax-cache-")


def subprocess_env() -> dict[str, str]:
    """os.environ without the eight fake devices of conftest, plus the shared cache."""
    return {**os.environ, "XLA_FLAGS": "", "JAX_COMPILATION_CACHE_DIR": COMPILE_CACHE,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
