"""The run: starting, watching and stopping the parts the plan (pdkv.deploy.plan) resolved, on this host.

- `preflight`: every reason the parts would fail to start here, found before anything starts;
- `stages`: in which order the parts start (bootstrap, engines, proxy);
- `process`: `ManagedProcess`, one supervised child (process group, log, health, bounded stop);
- `restart`: `RestartPolicy`, when a part that died starts again (pure);
- `supervisor`: start the parts in order, each healthy before the next, restart what dies, stop in reverse;
- `autoscaler`: the `Autoscaler`, starting and draining engines as the proxy's planner asks;
- `scale_policy`: its rules: how many engines to start or drain, when a failed step is tried again (pure);
- `lifeline`, `watchdog`: the parts never outlive `pdkv up`: a watchdog process stops them if it dies;
- `leftovers`: the record of what a `pdkv up` started, what of it still runs, and `pdkv down`;
- `warmup`: the first request, before the deployment is announced ready;
- `parts_run`: `hand_out_key`, `prepare` and `PartsRun`: `pdkv up`'s run as a library;
- `status`: health, bootstrap registrations and proxy figures of a running deployment.
"""

from pdkv.deploy.run.autoscaler import ScaleEvent
from pdkv.deploy.run.leftovers import UpRecord, running, stop_recorded
from pdkv.deploy.run.lifeline import Lifeline
from pdkv.deploy.run.parts_run import PartsRun, hand_out_key, prepare
from pdkv.deploy.run.preflight import Problem, pd_disagreements, preflight, raise_problems, shared_cores
from pdkv.deploy.run.process import ManagedProcess
from pdkv.deploy.run.restart import RestartDecision, RestartPolicy, Verdict
from pdkv.deploy.run.status import StatusReport, collect_status, part_hosts, status_targets
from pdkv.deploy.run.supervisor import PartEvent, Supervisor

__all__ = [
    "Lifeline",
    "ManagedProcess",
    "PartEvent",
    "PartsRun",
    "Problem",
    "RestartDecision",
    "RestartPolicy",
    "ScaleEvent",
    "StatusReport",
    "Supervisor",
    "UpRecord",
    "Verdict",
    "collect_status",
    "hand_out_key",
    "part_hosts",
    "pd_disagreements",
    "preflight",
    "prepare",
    "raise_problems",
    "running",
    "shared_cores",
    "status_targets",
    "stop_recorded",
]
