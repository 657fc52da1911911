"""The engines' logging configuration: vLLM's default, less the spurious EngineDeadError of a clean stop (vLLM #48745)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from pdkv.deploy import deployment_parts, local_deployment
from pdkv.deploy.plan.vllm_logging import (
    HANDLER_FAILED,
    OUTPUT_LOGGER,
    QUIET_LINE,
    SHUTDOWN_LOGGER,
    SHUTDOWN_TRIGGERED,
    ShutdownTracebackFilter,
    logging_config,
    vllm_formatter,
    with_vllm_logging,
    write_logging_config,
)


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError: the filter knows it by name, as it must without vLLM."""


@pytest.fixture
def vllm_log():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handler.addFilter(ShutdownTracebackFilter())
    root = logging.getLogger("vllm")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
    yield out
    root.removeHandler(handler)
    root.propagate = True


def _handler_failed(error: Exception) -> None:
    try:
        raise error
    except Exception:
        logging.getLogger(OUTPUT_LOGGER).exception(HANDLER_FAILED)


def test_the_engine_dead_error_of_a_requested_shutdown_is_one_info_line(vllm_log: io.StringIO) -> None:
    logging.getLogger(SHUTDOWN_LOGGER).info(SHUTDOWN_TRIGGERED)
    _handler_failed(EngineDeadError("EngineCore encountered an issue."))
    lines = vllm_log.getvalue().splitlines()
    assert lines == [f"INFO {SHUTDOWN_LOGGER} {SHUTDOWN_TRIGGERED}", f"INFO {OUTPUT_LOGGER} {QUIET_LINE}"]


def test_before_a_shutdown_the_engine_dead_error_keeps_its_traceback(vllm_log: io.StringIO) -> None:
    _handler_failed(EngineDeadError("EngineCore encountered an issue."))
    text = vllm_log.getvalue()
    assert text.startswith(f"ERROR {OUTPUT_LOGGER} {HANDLER_FAILED}") and "Traceback" in text and "EngineDeadError" in text


def test_after_a_shutdown_another_error_keeps_its_traceback(vllm_log: io.StringIO) -> None:
    logging.getLogger(SHUTDOWN_LOGGER).info(SHUTDOWN_TRIGGERED)
    _handler_failed(ValueError("a real bug"))
    assert "Traceback" in vllm_log.getvalue() and "ValueError: a real bug" in vllm_log.getvalue()


def test_every_engine_gets_the_file_and_nothing_else_does(tmp_path: Path) -> None:
    parts = with_vllm_logging(deployment_parts(local_deployment(gpus=0)), tmp_path, environ={})
    path = str(tmp_path.resolve() / "vllm-logging.json")
    assert {p.launch.name: p.launch.env.get("VLLM_LOGGING_CONFIG_PATH") for p in parts} == {
        "bootstrap-0": None, "prefill-0": path, "decode-0": path, "proxy": None}
    assert write_logging_config(parts, tmp_path) == Path(path) and Path(path).exists()
    assert write_logging_config(deployment_parts(local_deployment(gpus=0)), tmp_path / "unused") is None
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("env", [{"VLLM_LOGGING_LEVEL": "DEBUG"}, {"VLLM_LOGGING_CONFIG_PATH": "/mine.json"},
                                 {"VLLM_CONFIGURE_LOGGING": "0"}])
def test_a_caller_who_configures_vllms_logging_keeps_it(tmp_path: Path, env: dict[str, str]) -> None:
    parts = deployment_parts(local_deployment(gpus=0))
    assert with_vllm_logging(parts, tmp_path, environ=env) == parts


def test_the_configuration_is_vllms_default_plus_the_filter() -> None:
    DEFAULT_LOGGING_CONFIG = pytest.importorskip("vllm.logger").DEFAULT_LOGGING_CONFIG  # noqa: N806

    ours = logging_config()
    filters = ours["handlers"]["vllm"].pop("filters")
    assert filters == ["pdkv_shutdown"]
    assert ours.pop("filters") == {"pdkv_shutdown": {"()": f"{ShutdownTracebackFilter.__module__}.ShutdownTracebackFilter"}}
    assert ours.pop("formatters") == {"vllm": {"()": f"{ShutdownTracebackFilter.__module__}.vllm_formatter"}}
    theirs = {k: v for k, v in DEFAULT_LOGGING_CONFIG.items() if k != "formatters"}
    assert ours == theirs  # as vLLM configures an engine writing into a pipe at INFO, colour off
    # the formatter is vLLM's own, with its default format (built for whichever vLLM runs)
    spec = DEFAULT_LOGGING_CONFIG["formatters"]["vllm"]
    formatter = vllm_formatter()
    assert f"{type(formatter).__module__}.{type(formatter).__name__}".endswith((spec.get("()") or spec["class"]).rsplit(".", 1)[1])
    assert formatter._fmt == spec["format"] and formatter.datefmt == spec["datefmt"]
