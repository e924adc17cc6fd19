"""Environment for tests that start lctrain in subprocesses."""

import os


def subprocess_env() -> dict[str, str]:
    """os.environ without the eight fake devices of conftest. It keeps the test run's
    persistent compilation cache (conftest.share_one_compilation_cache): a restart (after a
    kill, to resume, as a second process) loads the executables an earlier start compiled,
    as a user's cache would, instead of paying the compile again. A truncated entry (a kill
    mid-write) is only a warning to JAX, which then compiles."""
    return {**os.environ, "XLA_FLAGS": ""}
