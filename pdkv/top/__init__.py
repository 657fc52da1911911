"""What an operator sees of a running deployment: `pdkv top` and `pdkv up`'s console share it.

    model.py     Reading (one poll's figures) and TopView (two readings: rates, quantiles, gauges), pure
    collect.py   DeploymentReader: the proxy's /health and /metrics and each engine's /metrics (I/O)
"""

from pdkv.top.collect import DeploymentReader
from pdkv.top.model import EngineView, Reading, TopView, view
from pdkv.top.parts import part_rows

__all__ = ["DeploymentReader", "EngineView", "Reading", "TopView", "part_rows", "view"]
