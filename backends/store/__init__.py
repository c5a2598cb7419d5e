"""Built-in store policies: which confirmed GPU blocks go to the CPU tier, and when."""

from kvkit.backends.store.eager import EagerStore
from kvkit.backends.store.lazy import LazyStore
from kvkit.backends.store.never import NeverStore
from kvkit.backends.store.selective import SelectiveStore

__all__ = ["EagerStore", "LazyStore", "NeverStore", "SelectiveStore"]
