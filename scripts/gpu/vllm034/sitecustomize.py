"""The GPU tier's stand-in for one of vLLM 0.34's kernel warm-ups, put first on PYTHONPATH by scripts/gpu/run.sh.

vLLM 0.34 imports `vllm.model_executor.warmup.minimax_m3_msa_warmup` on every CUDA host; that module imports the
MiniMax-M3 kernels, written in NVIDIA's CuTe DSL (`import cutlass`), which the GPU bundle does not carry. The
tier serves a Qwen3-8B-shaped model that never uses them, so the warm-up is replaced by a function that does
nothing. Users who `pip install vllm` get the CuTe DSL with it and need none of this.
"""

import sys
import types

_name = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
_stand_in = types.ModuleType(_name)
_stand_in.minimax_m3_msa_warmup = lambda worker: None
sys.modules.setdefault(_name, _stand_in)
