"""What this machine can still allocate: checked before kvkit allocates a pool, a mirror or a cache.

An allocation that cannot succeed is refused up front with an
:class:`~kvkit.errors.InsufficientMemoryError` naming every size in bytes,
instead of a raw ``MemoryError``, a torch ``RuntimeError`` or the OOM killer
halfway through building a stack. Importing this module does not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvkit.errors import InsufficientMemoryError

if TYPE_CHECKING:
    import torch

__all__ = ["BOOKKEEPING_BYTES_PER_BLOCK", "available_bytes", "check_fits", "host_available_bytes"]

BOOKKEEPING_BYTES_PER_BLOCK = 100
"""Host bytes one block of a pool costs in a stack's Python bookkeeping, before any use.

Measured ~110 for the built-in pool with LRU and the manager (refcount, hash
and free lists are Python lists, O(blocks)); a lower bound, so a stack that
fits is never refused for it.
"""

_CGROUP = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" when unlimited


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def host_available_bytes() -> int | None:
    """Bytes of host memory this process can still allocate, or ``None`` where unknown.

    ``MemAvailable`` of ``/proc/meminfo`` (else ``os.sysconf``'s available
    pages), capped by the cgroup v2 limit (``memory.max - memory.current``),
    which a container's ``/proc/meminfo`` does not show.
    """
    available = _meminfo_available()
    limit, used = _read_int(_CGROUP / "memory.max"), _read_int(_CGROUP / "memory.current")
    if limit is not None and used is not None:
        room = max(0, limit - used)
        available = room if available is None else min(available, room)
    return available


def available_bytes(device: torch.device | str) -> int | None:
    """Bytes that can still be allocated on ``device`` (``"cpu"``: host memory), or ``None`` where unknown.

    On CUDA: the driver's free memory plus what torch's caching allocator
    holds reserved but unused (it reuses that before asking the driver).
    """
    if _on_host(device):
        return host_available_bytes()
    import torch  # deferred: only a check of device memory loads torch

    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _on_host(device: torch.device | str) -> bool:
    return str(device).partition(":")[0] == "cpu"


def _size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def check_fits(device: torch.device | str, needs: Mapping[str, int]) -> None:
    """Raise unless everything in ``needs`` (what -> bytes) fits together on ``device`` now.

    Where the available memory is unknown nothing is refused.

    Raises:
        InsufficientMemoryError: the sum exceeds what is available; the
            message names each size and the bytes available.
    """
    total = sum(needs.values())
    available = available_bytes(device)
    if available is None or total <= available:
        return
    where = "host memory" if _on_host(device) else f"memory on {device}"
    parts = "; ".join(f"{what}: {_size(n)}" for what, n in needs.items())
    raise InsufficientMemoryError(
        f"cannot allocate {_size(total)} of {where} ({parts}); only {_size(available)} available; "
        f"nothing was allocated")
