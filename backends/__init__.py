"""Built-in implementations of kvkit's protocols (``kvkit.backends``).

Nothing here is imported by ``import kvkit``: the registry loads each backend
lazily by name, so optional dependencies (CuPy, the CUDA driver bindings) are
only touched when that backend is asked for.
"""
