"""pdkv: run prefill/decode disaggregated vLLM serving.

The package imports nothing heavy at start-up; vLLM, torch, Mooncake and ZMQ
are imported inside the functions that need them.
"""

__version__ = "0.1.0"
