"""The few CUDA driver calls the GPU copy backends need, through ``ctypes`` on ``libcuda``.

ctypes instead of cuda-python's bindings: descriptor arrays go to the driver
as raw numpy buffers (cuda-python wants one Python object per pointer), and
nothing beyond the system driver is needed. The library loads on first use
(:func:`driver`), never at import. The batched-copy entry points are looked up
once through ``cuGetProcAddress`` at the ABI the driver speaks: CUDA 12.8's
(with a ``failIdx`` out-parameter) or CUDA 13's ``_v2`` (without it).
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import attrs
import numpy as np

from kvkit.errors import BackendUnavailableError, DeviceError
from kvkit.validate import plural

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

__all__ = [
    "BATCH_OP_DTYPE",
    "MIN_DRIVER_VERSION",
    "ORDER_ANY",
    "ORDER_STREAM",
    "Driver",
    "driver",
    "driver_problem",
]

MIN_DRIVER_VERSION = 12080
"""``cuMemcpyBatchAsync`` first shipped with CUDA 12.8."""

ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
ORDER_ANY = 3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY
FLAG_PREFER_OVERLAP = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
LOC_DEVICE, LOC_HOST = 1, 2  # CUmemLocationType
POINTER_OPERAND = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_ATTR_DEVICE_POINTER = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER

# CUmemcpyAttributes (24 bytes on x86-64 and aarch64).
ATTRS_DTYPE = np.dtype([("order", "<i4"), ("src_loc", "<i4"), ("src_id", "<i4"),
                        ("dst_loc", "<i4"), ("dst_id", "<i4"), ("flags", "<u4")])
# CUmemcpy3DOperand, pointer arm of the union (40 bytes).
_OPERAND_DTYPE = np.dtype([("type", "<i4"), ("_pad", "<i4"), ("ptr", "<u8"), ("row", "<u8"),
                           ("layer", "<u8"), ("loc", "<i4"), ("loc_id", "<i4")])
BATCH_OP_DTYPE = np.dtype([("src", _OPERAND_DTYPE), ("dst", _OPERAND_DTYPE), ("width", "<u8"),
                           ("height", "<u8"), ("depth", "<u8"), ("order", "<i4"), ("flags", "<u4")])
"""``CUDA_MEMCPY3D_BATCH_OP`` (112 bytes), filled column-wise by numpy."""
assert ATTRS_DTYPE.itemsize == 24 and _OPERAND_DTYPE.itemsize == 40 and BATCH_OP_DTYPE.itemsize == 112

_p, _sz = ctypes.c_void_p, ctypes.c_size_t
_BATCH_12 = ctypes.CFUNCTYPE(ctypes.c_int, _p, _p, _p, _sz, _p, _p, _sz, _p, _p)
_BATCH_13 = ctypes.CFUNCTYPE(ctypes.c_int, _p, _p, _p, _sz, _p, _p, _sz, _p)
_BATCH3D_12 = ctypes.CFUNCTYPE(ctypes.c_int, _sz, _p, _p, ctypes.c_ulonglong, _p)
_BATCH3D_13 = ctypes.CFUNCTYPE(ctypes.c_int, _sz, _p, ctypes.c_ulonglong, _p)


@attrs.define(eq=False)
class Driver:
    """``libcuda`` with the batched-copy entry points resolved for this driver's ABI.

    Attributes:
        version: the driver's CUDA version (``12080`` for 12.8).
    """

    lib: ctypes.CDLL
    version: int
    _batch: CFuncPtr | None  # None: driver older than 12.8
    _batch3d: CFuncPtr | None
    _with_fail_idx: bool

    @classmethod
    def load(cls) -> Driver:
        """Open ``libcuda`` and look the entry points up once.

        Raises:
            BackendUnavailableError: no driver library.
            DeviceError: the driver failed to initialise.
        """
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise BackendUnavailableError(f"no CUDA driver: {exc}") from exc
        version = ctypes.c_int(0)
        _check(lib, lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        _check(lib, lib.cuInit(0), "cuInit")
        if version.value < MIN_DRIVER_VERSION:
            return cls(lib, version.value, None, None, False)
        abi = 13000 if version.value >= 13000 else MIN_DRIVER_VERSION
        with_fail_idx = abi < 13000
        batch = _proc(lib, b"cuMemcpyBatchAsync", abi)
        batch3d = _proc(lib, b"cuMemcpy3DBatchAsync", abi)
        return cls(lib, version.value,
                   (_BATCH_12 if with_fail_idx else _BATCH_13)(batch),
                   (_BATCH3D_12 if with_fail_idx else _BATCH3D_13)(batch3d),
                   with_fail_idx)

    def batch_problem(self) -> str | None:
        """Why batched copies are unavailable with this driver, or ``None``."""
        if self._batch is None:
            return (f"the CUDA driver supports CUDA {_dotted(self.version)}; batched copies "
                    f"(cuMemcpyBatchAsync) need a driver for CUDA {_dotted(MIN_DRIVER_VERSION)} or newer")
        return None

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray,
                     attributes: np.ndarray, stream: int) -> None:
        """Enqueue ``size[i]`` bytes from ``src[i]`` to ``dst[i]`` for every ``i``: one driver call.

        The arrays must be contiguous ``uint64`` (``attributes``: one
        ``ATTRS_DTYPE`` record for every copy); ``stream`` must not be 0.
        """
        n = len(size)
        assert self._batch is not None and stream != 0 and n and dst.dtype == src.dtype == size.dtype == np.uint64
        idx = np.zeros(1, dtype=np.uint64)
        args = [dst.ctypes.data, src.ctypes.data, size.ctypes.data, n,
                attributes.ctypes.data, idx.ctypes.data, 1]
        if self._with_fail_idx:
            fail = ctypes.c_size_t(0)
            res = self._batch(*args, ctypes.addressof(fail), stream)
            what = f"cuMemcpyBatchAsync ({plural(n, 'copy', 'copies')}, first failing: {fail.value})"
        else:
            res = self._batch(*args, stream)
            what = f"cuMemcpyBatchAsync ({plural(n, 'copy', 'copies')})"
        _check(self.lib, res, what)

    def memcpy_3d_batch(self, ops: np.ndarray, stream: int) -> None:
        """Enqueue every ``BATCH_OP_DTYPE`` record of ``ops``: one driver call."""
        n = len(ops)
        assert (self._batch3d is not None and stream != 0 and n and ops.dtype == BATCH_OP_DTYPE
                and ops.flags.c_contiguous)
        if self._with_fail_idx:
            fail = ctypes.c_size_t(0)
            res = self._batch3d(n, ops.ctypes.data, ctypes.addressof(fail), 0, stream)
            what = f"cuMemcpy3DBatchAsync ({plural(n, 'copy', 'copies')}, first failing: {fail.value})"
        else:
            res = self._batch3d(n, ops.ctypes.data, 0, stream)
            what = f"cuMemcpy3DBatchAsync ({plural(n, 'copy', 'copies')})"
        _check(self.lib, res, what)

    def device_address(self, host_ptr: int) -> int | None:
        """Where the device sees page-locked host memory at ``host_ptr``; ``None`` if not page-locked."""
        out = ctypes.c_uint64(0)
        res = self.lib.cuPointerGetAttribute(ctypes.byref(out), _ATTR_DEVICE_POINTER, ctypes.c_uint64(host_ptr))
        return out.value if res == 0 else None

    def ensure_context(self, context: int) -> None:
        """Make ``context`` current on the calling thread (driver calls need one)."""
        current = ctypes.c_void_p(0)
        _check(self.lib, self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if (current.value or 0) != context:
            _check(self.lib, self.lib.cuCtxSetCurrent(ctypes.c_void_p(context)), "cuCtxSetCurrent")

    def current_context(self) -> int:
        """The calling thread's current context (0 if none)."""
        current = ctypes.c_void_p(0)
        _check(self.lib, self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        return current.value or 0


def _dotted(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _proc(lib: ctypes.CDLL, symbol: bytes, abi: int) -> int:
    fn, status = ctypes.c_void_p(0), ctypes.c_int(0)
    _check(lib, lib.cuGetProcAddress_v2(symbol, ctypes.byref(fn), abi, ctypes.c_uint64(0), ctypes.byref(status)),
           f"cuGetProcAddress({symbol.decode()}, {abi})")
    if not fn.value:
        raise BackendUnavailableError(f"the CUDA driver has no {symbol.decode()} for CUDA {_dotted(abi)} "
                                      f"(lookup status {status.value})")
    return fn.value


def _check(lib: ctypes.CDLL, res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p(None)
        lib.cuGetErrorName(res, ctypes.byref(name))
        raise DeviceError(f"{what} failed: {(name.value or b'?').decode()} ({res})")


@functools.cache
def driver() -> Driver:
    """The process-wide :class:`Driver`, loaded on first call.

    Raises:
        BackendUnavailableError: no driver library (not cached: retried next call).
    """
    return Driver.load()


def driver_problem(*, batch: bool = False) -> str | None:
    """Why the driver (with batched copies if ``batch``) is unusable here, or ``None``. Never raises."""
    try:
        lib = driver()
    except (BackendUnavailableError, DeviceError, AttributeError) as exc:
        return str(exc)
    return lib.batch_problem() if batch else None
