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


def _build(kind: str, tmp_path_factory) -> Path:
    builder = _load("vllm_model", Path(__file__).with_name("vllm_model.py"))
    return getattr(builder, f"build_tiny_{kind}")(tmp_path_factory.mktemp(f"tiny-{kind}"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny, deterministic Llama checkpoint vLLM loads offline (built once per session)."""
    return _build("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    """A tiny Mistral with a 64-token sliding window on every layer (vLLM: one sliding-window group)."""
    return _build("mistral", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A tiny Gemma-3 alternating sliding-window and full-attention layers (vLLM: one group of each)."""
    return _build("gemma3", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory) -> Path:
    """A tiny bfloat16 DeepSeek-V3 with multi-head latent attention (vLLM: one MLA group)."""
    return _build("deepseek", tmp_path_factory)
