"""Eight fake CPU devices for every test; must run before jax is imported anywhere."""

import builtins
import os

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def without_libtpu(monkeypatch):
    """Importing libtpu fails, as on a machine without the tpu extra."""
    real_import = builtins.__import__

    def no_libtpu(name, *args, **kwargs):
        if name == "libtpu":
            raise ImportError("No module named 'libtpu'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libtpu)
