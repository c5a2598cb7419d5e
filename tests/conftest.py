"""Shared test configuration: Hypothesis profiles, the GPU and compiler markers and shared fixtures."""

import builtins
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=25, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _has_compiler() -> bool:
    return shutil.which("cc") is not None and Path(sysconfig.get_paths()["include"], "Python.h").exists()


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.gpu`` tests cleanly on machines without CUDA, ``@pytest.mark.compiler`` ones on
    machines that cannot build C extensions (there kvkit installs and runs its pure-Python loops)."""
    missing = {"gpu": None if _has_cuda() else pytest.mark.skip(reason="needs a CUDA GPU"),
               "compiler": None if _has_compiler() else pytest.mark.skip(reason="needs a C compiler and Python.h")}
    for item in items:
        for marker, skip in missing.items():
            if skip is not None and marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def python_loops():
    """Every compiled loop's default, for the objects made meanwhile, is its Python reference: for the tests
    that count the Python lines a call executes (a loop in C would hide its work from them)."""
    from kvkit.backends.allocator import loops
    from kvkit.backends.eviction import _chains, _queue, hit_density
    from kvkit.backends.eviction.hit_density import booking, selection

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loops, "COMPILED", None)
        patch.setattr(_queue, "LOOPS", _queue.REFERENCE)
        patch.setattr(hit_density, "_BOOKING", booking.REFERENCE)
        patch.setattr(hit_density, "_SELECTION", selection.REFERENCE)
        patch.setattr(_chains, "ADD_MANY", _chains.FlatChains.add_many_reference)
        patch.setattr(_chains, "REMOVE_MANY", _chains.FlatChains.remove_many_reference)
        yield


@pytest.fixture
def without_libcachesim(monkeypatch):
    """``import libcachesim`` fails, as without the ``libcachesim`` extra."""
    real = builtins.__import__

    def no_libcachesim(name, *args, **kwargs):
        if name == "libcachesim":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_libcachesim)
