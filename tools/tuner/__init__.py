"""Pool-ratio tuning: replay a trace through a simulated prefill/decode fleet calibrated by a
replica profile, and pick the smallest fleet that meets latency targets."""

from tools.tuner.fleet import FleetConfig
from tools.tuner.results import SimResult
from tools.tuner.search import Evaluator, TuneResult, tune
from tools.tuner.simulator import simulate
from tools.tuner.slo import SLO, parse_slo
from tools.tuner.trace import Trace, TraceError, load_trace

__all__ = [
    "SLO",
    "Evaluator",
    "FleetConfig",
    "SimResult",
    "Trace",
    "TraceError",
    "TuneResult",
    "load_trace",
    "parse_slo",
    "simulate",
    "tune",
]
