"""Every error pdkv raises, and the exit code each one maps to.

    PdkvError                  exit 1  (FAILED)
    ├── UsageError             exit 2  (USAGE)     bad flags, arguments or input files
    │   ├── ConfigError                            a model config or deploy file cannot be used
    │   └── UnsupportedModelError                  an architecture pdkv cannot size or serve
    ├── StartError             exit 3  (COULD_NOT_START)  a service or engine did not come up
    │   └── PreflightError                         a check before start-up failed
    ├── ChecksFailed           exit 4  (CHECKS_FAILED)    doctor found failures
    ├── RemoteError                                a peer answered with an error
    │   └── RegistryConflict                       the bootstrap registry refused a registration
    ├── UnreachableError                           a peer did not answer within its bound
    │   └── UpstreamError                          a proxied exchange ended without an HTTP answer
    ├── TransferError                              a KV transfer failed or arrived corrupted
    │   └── FrameError                             a frame of the socket transport's wire broke its format
    ├── EventDecodeError                           an engine's KV cache event could not be read
    ├── TimeoutError_                              a bounded wait ran out
    ├── ParamsError (also a ValueError)            kv_transfer_params a connector cannot serve
    └── GpuLookupError                             NVML could not list the GPUs (doctor)

The library raises these; only the CLI turns them into a one-line message,
a hint and an exit code.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    COULD_NOT_START = 3
    CHECKS_FAILED = 4


class PdkvError(Exception):
    """Base of every pdkv error: a message, an optional hint, an exit code."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(PdkvError):
    exit_code = ExitCode.USAGE


class ConfigError(UsageError):
    pass


class UnsupportedModelError(UsageError):
    pass


class StartError(PdkvError):
    exit_code = ExitCode.COULD_NOT_START


class PreflightError(StartError):
    pass


class ChecksFailed(PdkvError):
    exit_code = ExitCode.CHECKS_FAILED


class RemoteError(PdkvError):
    """A peer answered, but with an error. `status` is its HTTP status, if any."""

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class RegistryConflict(RemoteError):
    pass


class UnreachableError(PdkvError):
    pass


class TransferError(PdkvError):
    pass


class FrameError(TransferError):
    pass


class EventDecodeError(PdkvError):
    pass


class TimeoutError_(PdkvError):  # noqa: N801 - avoid shadowing the builtin
    pass


class UpstreamError(UnreachableError):
    """A proxied exchange with a backend failed without an HTTP answer. `cause`: connect, timeout,
    disconnect or cancelled (pdkv.proxy.http sets it; pdkv.proxy.error_answers words it for the client)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class ParamsError(PdkvError, ValueError):
    """kv_transfer_params that cannot be served; the message is shown to the client.
    Still a ValueError, as it was before it joined this tree."""


class GpuLookupError(PdkvError):
    """NVML could not list GPUs; `missing` is True when there is no NVML or no driver at all."""

    def __init__(self, message: str, *, missing: bool) -> None:
        super().__init__(message)
        self.missing = missing
