"""Block pools: refcounted, prefix-indexed slots for either tier."""

from kvkit.backends.allocator.pool import BlockPool

__all__ = ["BlockPool"]
