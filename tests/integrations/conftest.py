"""Fixtures of the engine integration tests.

The suite runs with ``--import-mode=importlib``, which puts no test folder on
``sys.path``, so the tiny-model builder is loaded from its file here.
"""

import importlib.util
from pathlib import Path

import pytest


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny, deterministic Llama checkpoint vLLM loads offline (built once per session)."""
    builder = _load("vllm_model", Path(__file__).with_name("vllm_model.py"))
    return builder.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
