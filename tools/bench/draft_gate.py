"""`splitserve draft gate`: a new draft ships only if it pays on replayed traffic.

The held-out slice of the training log (training_log.split_heldout: the chats the
trainer never saw) is replayed greedy at each production batch size with no draft, with the
draft in service (if any) and with the candidate, on the same loaded weights and drafting as
the pool does (the CLI's --method: adaptive, which prices each step's drafts, by default;
a head that pays alone at batch 1 can lose at batch 8 when it always drafts), the three
taking turns prompt by prompt (batch 8: twice over the batch, in alternating order). The candidate
is accepted only if its greedy output equals plain decoding's at every batch size (a draft
can never change it through exact verification, so a difference means a bug somewhere and
must stop the rollout) and its decode tokens/s over the whole replay (all batch sizes
together) beats both no-draft and the draft in service by at least `min_gain`. The default is
3%, about three times the spread measured between identical arms: one head file, replayed
as both candidate and draft in service, interleaved on a 2-core AVX2 VM, gave 33.08 and
32.77 tok/s. Two heads trained a session apart measured 1.7% apart, an edge that does not
pay for swapping every pool's draft. Accepted, it can be installed at the
pool's draft path atomically; the pools' watchers then swap it in between steps.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.engine import Engine
from shared.sampling.params import SamplingParams
from tools.bench.spec_bench import decode_run, interleaved_runs


@dataclass
class GateRun:
    name: str  # "none" | "current" | "candidate"
    outputs: dict[int, list[list[int]]]  # batch size -> outputs
    tokens: int  # decode-step tokens over every batch size
    seconds: float
    mean_accepted: float
    draft_unavailable: str | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_json(self, plain: GateRun) -> dict:
        out = {
            "tok_s": round(self.tok_s, 2),
            "speedup": round(self.tok_s / plain.tok_s, 3) if plain.tok_s else None,
            "mean_accepted": self.mean_accepted,
            "identical_greedy": self.outputs == plain.outputs,
        }
        if self.draft_unavailable:
            out["draft_unavailable"] = self.draft_unavailable
        return out


@dataclass
class GateVerdict:
    accepted: bool
    reasons: list[str]
    runs: dict[str, GateRun] = field(default_factory=dict)

    def as_json(self) -> dict:
        plain = self.runs["none"]
        return {
            "accepted": self.accepted,
            "reasons": self.reasons,
            "runs": {name: run.as_json(plain) for name, run in self.runs.items()},
        }


EngineFactory = Callable[[str | None], Engine]  # draft path (None: no draft) -> fresh engine


DEFAULT_MIN_GAIN = 0.03


def decide(runs: dict[str, GateRun], min_gain: float = DEFAULT_MIN_GAIN) -> GateVerdict:
    """The verdict on runs "none", "candidate" and (when a draft serves) "current": the
    candidate's tokens/s must exceed each rival's by the fraction `min_gain`."""
    plain, candidate = runs["none"], runs["candidate"]
    reasons = []
    if candidate.draft_unavailable:
        reasons.append(f"the candidate did not load: {candidate.draft_unavailable}")
    for batch, outputs in candidate.outputs.items():
        if outputs != plain.outputs[batch]:
            reasons.append(f"greedy output differs from plain decoding at batch {batch}")
    for rival in ("none", "current"):
        if rival in runs and candidate.tok_s <= runs[rival].tok_s * (1.0 + min_gain):
            needed = f" by {min_gain:.0%}" if min_gain else ""
            reasons.append(
                f"{candidate.tok_s:.1f} tok/s does not beat {rival}'s "
                f"{runs[rival].tok_s:.1f}{needed}"
            )
    margin = f" by more than {min_gain:.0%}" if min_gain else ""
    done = f"faster than every rival{margin}, output identical"
    return GateVerdict(not reasons, reasons or [done], runs)


def gate(
    make_engine: EngineFactory,
    prompts: list[list[int]],
    candidate: str,
    current: str | None,
    batches: tuple[int, ...] = (1, 8),
    max_tokens: int = 64,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> GateVerdict:
    """Every arm replays the same prompts, the arms taking turns group by group
    (spec_bench.interleaved_runs): timed one after the other, this VM's drifting speed was
    enough to decide a verdict."""
    drafts = {"none": None, "current": current, "candidate": candidate}
    if current is None:
        del drafts["current"]
    engines = {name: make_engine(draft) for name, draft in drafts.items()}
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for engine in engines.values():
        decode_run(engine, prompts[:1], warm, 1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs: dict[str, dict[int, list[list[int]]]] = {name: {} for name in engines}
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    for batch in batches:
        for name, (outs, n, dt) in interleaved_runs(engines, prompts, params, batch).items():
            outputs[name][batch] = outs
            tokens[name] += n
            seconds[name] += dt
    runs = {}
    for name, engine in engines.items():
        stats = engine.spec_stats()
        mean = stats["mean_accepted"] if drafts[name] is not None else 1.0
        runs[name] = GateRun(
            name, outputs[name], tokens[name], seconds[name], mean, stats.get("draft_unavailable")
        )
    return decide(runs, min_gain)


def install(candidate: str | Path, served: str | Path) -> Path:
    """Copy the accepted candidate over the served draft path, atomically (copy, rename)."""
    served = Path(served).expanduser()
    served.parent.mkdir(parents=True, exist_ok=True)
    tmp = served.with_name(served.name + ".installing")
    shutil.copyfile(candidate, tmp)
    os.replace(tmp, served)
    return served
