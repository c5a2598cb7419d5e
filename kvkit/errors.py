"""Every error kvkit raises on purpose.

Each error subclasses :class:`KVKitError` *and* the built-in exception a caller
would naturally catch (``ValueError``, ``KeyError``, ``RuntimeError``...), so
``except ValueError`` keeps working around kvkit code. Messages quote the bad
value. ``assert`` is reserved for kvkit's own bugs. No message shows a secret:
every one passes through :func:`kvkit.redact.redact_text`.
"""

from __future__ import annotations

from typing_extensions import override

from kvkit.redact import redact_text

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "DeviceError",
    "HashInputError",
    "InsufficientMemoryError",
    "KVKitError",
    "OutOfBlocksError",
    "PlanError",
    "PoolUsageError",
    "RefcountError",
    "RequestStateError",
    "SpecMismatchError",
    "TraceFileError",
    "TraceFormatError",
    "TransferTimeoutError",
    "UnknownBlockError",
    "UnknownRequestError",
    "UnsupportedModelError",
]


class KVKitError(Exception):
    """Base class of every error kvkit raises on purpose; its text arguments are redacted (no secret shown)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class OutOfBlocksError(KVKitError, MemoryError):
    """An allocation could not be satisfied; the pool is unchanged."""


class RefcountError(KVKitError, ValueError):
    """A reference count would go negative, or a free block was referenced."""


class UnknownBlockError(KVKitError, IndexError):
    """A block id outside ``[0, num_blocks)``."""


class PoolUsageError(KVKitError, ValueError):
    """A pool call that cannot apply: negative count, unequal lengths, a block committed twice."""


class HashInputError(KVKitError, ValueError):
    """Tokens, block size, salt or algorithm given to the block hasher are malformed."""


class UnknownRequestError(KVKitError, KeyError):
    """A request id the manager does not know (never added, or already gone)."""

    @override
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RequestStateError(KVKitError, RuntimeError):
    """A call that is not valid in the request's current state (e.g. a second finish)."""


class ConfigError(KVKitError, ValueError):
    """A stack configuration is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [redact_text(str(p)) for p in ([problems] if isinstance(problems, str) else problems)]
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} configuration problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


class InsufficientMemoryError(ConfigError, MemoryError):
    """A size this machine cannot allocate (host or device memory); raised before allocating anything.

    The message names the size in bytes, what needs it, and the bytes available.
    """


class SpecMismatchError(KVKitError, ValueError):
    """A tensor's shape, dtype or device disagrees with the ``KVCacheSpec``."""


class PlanError(KVKitError, ValueError):
    """A transfer plan is malformed: ids out of range, lengths differ, unknown region."""


class BackendUnavailableError(KVKitError, RuntimeError):
    """A registered component cannot run on this machine (missing library or device)."""


class DeviceError(KVKitError, RuntimeError):
    """A CUDA driver call failed at run time; the message names the call and the error code."""


class TraceFormatError(KVKitError, ValueError):
    """A trace line is malformed; the message names the file, line and field."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        self.path, self.line, self.field = path, line, field
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")


class TraceFileError(KVKitError, OSError):
    """A trace file cannot be opened or read (missing, a directory, no permission); the message names it."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        super().__init__(f"{path}: {problem}")


class TransferTimeoutError(KVKitError, TimeoutError):
    """Transfers did not complete within a wait's timeout; they stay in flight, nothing was freed.

    Attributes:
        pending: the transfer ids still in flight when the wait gave up.
    """

    def __init__(self, message: str, pending: tuple[int, ...] = ()) -> None:
        self.pending = pending
        super().__init__(message)


class UnsupportedModelError(KVKitError, TypeError):
    """A model whose KV cache kvkit cannot hold (its family, attention kind or library version)."""
