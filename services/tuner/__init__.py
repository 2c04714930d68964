"""Pool-ratio tuning: replay a trace through a simulated prefill/decode fleet calibrated by a
replica profile, and pick the smallest fleet that meets latency targets."""

from services.tuner.fleet import FleetConfig
from services.tuner.results import SimResult
from services.tuner.search import Evaluator, TuneResult, tune
from services.tuner.simulator import simulate
from services.tuner.slo import SLO, parse_slo
from services.tuner.trace import Trace, TraceError, load_trace

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
