"""Test-only shim: a fake accelerator index so vLLM 0.32's own MooncakeConnector runs on CPU.

vLLM's MooncakeConnector worker calls `torch.accelerator.current_device_index()`
(which raises on a host with no accelerator) and then
`current_platform.set_device(index)`. On a CPU host there is no device to
pick, so this shim makes the first return 0 and the second do nothing.

It is loaded only by vLLM processes that the e2e fixtures start with this
folder on PYTHONPATH (`start_vllm(..., cpu_accelerator_shim=True)`), and it
patches only after the connector module is imported, so every other import
is untouched. pdkv's own connector needs no shim.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"


def _patch(module) -> None:
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0
    platform = module.current_platform
    type(platform).set_device = classmethod(lambda cls, device: None)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds TARGET through the other finders, then patches right after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original = loader.exec_module

                def exec_module(module, _original=original):
                    _original(module)
                    _patch(module)

                loader.exec_module = exec_module
                return spec
        return None


sys.meta_path.insert(0, _PatchAfterImport())
