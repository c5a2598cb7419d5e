"""``hold_every_descriptor()``: use up this process's file descriptors, for tests of what runs out of them.

A store must treat a process out of descriptors (``EMFILE``) as its own shortage, never as evidence
against a server or a file; a test lowers ``RLIMIT_NOFILE`` (so the loop is short), takes what is left
with this, and gives descriptors back with ``os.close`` to let the store recover.
"""

from __future__ import annotations

import os

__all__ = ["hold_every_descriptor"]


def hold_every_descriptor() -> tuple[list[int], int]:
    """Open ``os.devnull`` until the process may open no more; return the descriptors now held (the caller closes
    them) and the ``errno`` that stopped the loop (``EMFILE`` under ``RLIMIT_NOFILE``)."""
    held: list[int] = []
    while True:
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            return held, exc.errno or 0
