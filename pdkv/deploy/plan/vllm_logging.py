"""vLLM's own logging for the engines `pdkv up` starts, less one traceback that a clean stop logs.

vLLM 0.32's API server stops its engine client on an executor thread while
its event loop keeps running. The client's teardown cancels the task that
reads the engine core's outputs; that task hands the output handler, still
running, an EngineDeadError, which is logged as "AsyncLLM output_handler
failed." with a traceback, although nothing failed (vllm-project/vllm#48745;
its fix, #49000, is still open). It is a race: on the 2-core host it was in
1 of 3 Ctrl-C stops with the whole process group signalled at once, and in 1
of 4 with the API server signalled first.

`pdkv up` points each engine at a logging configuration (the
`VLLM_LOGGING_CONFIG_PATH` file `write_logging_config` writes): vLLM's
default (0.26 or 0.32, whichever runs), plus `ShutdownTracebackFilter` on its handler. Once the API server
has logged "[shutdown] API server: shutdown triggered", that one record
becomes an INFO line without the traceback; every other record, and that
record before a shutdown began (a real engine failure), is left as it is.
An engine whose environment (or the caller's) sets any VLLM_LOGGING_* or
VLLM_CONFIGURE_LOGGING variable keeps vLLM's logging untouched.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from pdkv.deploy.plan.topology import Part

CONFIG_NAME = "vllm-logging.json"
SHUTDOWN_LOGGER = "vllm.entrypoints.launchers.launcher"
SHUTDOWN_TRIGGERED = "[shutdown] API server: shutdown triggered"
OUTPUT_LOGGER = "vllm.v1.engine.async_llm"
HANDLER_FAILED = "AsyncLLM output_handler failed."
QUIET_LINE = "AsyncLLM output_handler: the engine core stopped with the shutdown (vllm-project/vllm#48745; not a failure)"


class ShutdownTracebackFilter(logging.Filter):
    """Turns vLLM's spurious "output_handler failed" EngineDeadError after a requested shutdown into one INFO line."""

    def __init__(self) -> None:
        super().__init__()
        # Set by the event loop's signal handler, read by whichever thread logs: an Event is the lock.
        self._stopping = threading.Event()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == SHUTDOWN_LOGGER and str(record.msg).startswith(SHUTDOWN_TRIGGERED):
            self._stopping.set()
        elif (self._stopping.is_set() and record.name == OUTPUT_LOGGER and record.msg == HANDLER_FAILED
              and record.exc_info and type(record.exc_info[1]).__name__ == "EngineDeadError"):
            record.msg, record.args = QUIET_LINE, ()
            record.exc_info = record.exc_text = record.stack_info = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def vllm_formatter() -> logging.Formatter:
    """vLLM's own default text formatter, built in the engine's process for the vLLM running there.

    Called by `logging.config` while `vllm.logger` configures itself (so that module is already loaded): its
    DEFAULT_LOGGING_CONFIG names the class and format; 0.32's formatter takes a `log_level`, 0.26's does not.
    """
    import importlib
    import inspect
    import sys

    vllm_logger = sys.modules.get("vllm.logger") or importlib.import_module("vllm.logger")
    spec = dict(vllm_logger.DEFAULT_LOGGING_CONFIG["formatters"]["vllm"])
    module, _, name = (spec.get("()") or spec["class"]).rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    kwargs = {"log_level": "INFO"} if "log_level" in inspect.signature(cls).parameters else {}
    return cls(spec["format"], spec.get("datefmt"), **kwargs)


def logging_config() -> dict[str, Any]:
    """vLLM's default (INFO, stdout, no colour: the engines write into a pipe; its own formatter), plus the filter."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"pdkv_shutdown": {"()": f"{__name__}.ShutdownTracebackFilter"}},
        "formatters": {"vllm": {"()": f"{__name__}.vllm_formatter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO", "stream": "ext://sys.stdout",
                              "filters": ["pdkv_shutdown"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    }


def _configures_vllm_logging(env: Mapping[str, str]) -> bool:
    return any(k.startswith("VLLM_LOGGING_") or k == "VLLM_CONFIGURE_LOGGING" for k in env)


def with_vllm_logging(parts: Sequence[Part], log_dir: str | Path, environ: Mapping[str, str] | None = None) -> list[Part]:
    """`parts` with VLLM_LOGGING_CONFIG_PATH (the file in `log_dir`) set for every vLLM engine, unless
    the caller's environment or the engine's own sets up vLLM's logging. Pure: writes nothing."""
    if _configures_vllm_logging(os.environ if environ is None else environ):
        return list(parts)
    path = str(Path(log_dir).resolve() / CONFIG_NAME)
    out = []
    for part in parts:
        if part.spec is not None and not _configures_vllm_logging(part.launch.env):
            launch = msgspec.structs.replace(part.launch, env={**part.launch.env, "VLLM_LOGGING_CONFIG_PATH": path})
            part = msgspec.structs.replace(part, launch=launch)
        out.append(part)
    return out


def write_logging_config(parts: Sequence[Part], log_dir: str | Path) -> Path | None:
    """Write the logging configuration into `log_dir` (created if missing) when one of `parts` uses it; its path."""
    path = Path(log_dir).resolve() / CONFIG_NAME
    if not any(p.launch.env.get("VLLM_LOGGING_CONFIG_PATH") == str(path) for p in parts):
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(logging_config(), indent=1) + "\n")
    return path
