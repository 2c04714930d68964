"""The planner: sizes each model's prefill and decode pools from the coordinator's metrics.

`metrics` scrapes and parses the coordinator's Prometheus counters into samples, `forecast`
projects a rate forward, `decide` turns a window of samples into replica counts (a pure
function), `cooldown` holds changes back after a recent one, `kube` reads and sets the counts
through the Kubernetes scale subresource, and `loop` ties them together on a timer.
"""

from services.planner.decide import Decision, Policy, PoolSizes, decide
from services.planner.metrics import MetricSample, parse_metrics

__all__ = ["Decision", "MetricSample", "Policy", "PoolSizes", "decide", "parse_metrics"]
