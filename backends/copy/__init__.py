"""Built-in copy backends (``kvkit.backends.copy``).

Each backend lives in its own module and is loaded lazily by the registry;
modules needing optional libraries (CuPy, cuda-python) must not be imported
here.
"""

from kvkit.backends.copy.torch_copy import TorchCopy

__all__ = ["TorchCopy"]
