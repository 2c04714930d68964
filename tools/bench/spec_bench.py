"""`splitserve bench spec`: decode speed with speculative decoding against plain decoding.

Two prompt sets (tools/bench/data/spec_prompts.json): `chat`, a consumer chat with a stable
persona, and `grounded`, work whose answer copies from its input (edit, summarise, rewrite).
Every method runs on the same loaded weights with the same prompts, greedy, at batch 1 (the
prompts one after another) and batch 8 (all together); `speedup` divides by `none` from the
same run, and `identical_greedy` checks the outputs equal plain decoding's token for token.
The methods take turns prompt by prompt (batch 8: twice over the batch, in alternating
order), so that the machine's drifting speed falls on every method alike.

tok/s counts decode steps only (steps with no prompt work in them): prefill is the same for
every method and would only dilute the ratio that speculation changes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.model_setup import load_serving_model
from engine.kvcache.kv_dtype import resolve_kv_dtype
from engine.model.fp32_gemm import settle as settle_fp32_gemm
from engine.model.loader import read_checkpoint
from engine.speculative.head_file import read_head
from shared.modelfile.default import default_model_path
from shared.sampling.params import SamplingParams
from shared.tokenizer import Tokenizer
from tools.bench.spec_head import train_bench_head, write_replay_log
from tools.bench.spec_methods import HEAD_MINUTES, METHODS, SETS

BENCH_HEADS = Path("~/.cache/splitserve/bench")
BATCHES = (1, 8)
PROMPTS_FILE = "spec_prompts.json"
# Timed passes over a set that is one batch (chat and grounded at b8: 8 prompts each). Two
# passes left a b8 speedup +-0.15 from run to run (chat adaptive b8 1.29-1.68x over ten runs
# of the same head, sessions 21-22: each pass lasts ~5 s, and the adaptive controller prices
# k from step times the machine's drift moves). Four average twice the passes; with four,
# session 23's two full runs read 1.37x and 1.25x, so the spread is not gone.
SINGLE_GROUP_ROUNDS = 4


def load_prompt_sets(
    tokenizer: Tokenizer,
    replay: Engine | None = None,
    reply_tokens: int = 64,
    earlier: list[tuple[list[int], list[int]]] | None = None,
) -> dict[str, list[list[int]]]:
    """Token prompts per set. A chat conversation is a list of user turns; as in real
    traffic, each earlier turn's assistant reply is the target's own (greedy, plain decoding
    on `replay`, all conversations batched) and the whole conversation is resent with the
    last user turn: that last turn is what the benchmark decodes. Without `replay` (tests)
    the earlier turns are left out. `earlier` collects each replayed (prompt, reply) pair:
    traffic disjoint from what the benchmark times (a draft head trains on it)."""
    data = json.loads((resources.files("tools.bench") / "data" / PROMPTS_FILE).read_text())
    chat, grounded = data["chat"], data["grounded"]
    system = {"role": "system", "content": chat["system"]}
    histories = [[system] for _ in chat["conversations"]]
    turns = max(len(c) for c in chat["conversations"])
    for turn in range(turns - 1):
        live = [i for i, c in enumerate(chat["conversations"]) if turn < len(c) - 1]
        for i in live:
            histories[i].append({"role": "user", "content": chat["conversations"][i][turn]})
        if replay is None:
            continue
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(histories[i])) for i in live]
        replies = replay.generate(prompts, SamplingParams(temperature=0.0, max_tokens=reply_tokens))
        if earlier is not None:
            earlier.extend(zip(prompts, replies, strict=True))
        for i, reply in zip(live, replies, strict=True):
            text = tokenizer.decode([t for t in reply if t not in tokenizer.stop_token_ids])
            histories[i].append({"role": "assistant", "content": text.strip()})
    if replay is None:  # no replies to pair the earlier user turns with
        histories = [[system] for _ in chat["conversations"]]
    conversations = [
        [*history, {"role": "user", "content": c[-1]}]
        for history, c in zip(histories, chat["conversations"], strict=True)
    ]
    conversations += [
        [{"role": "system", "content": grounded["system"]}, {"role": "user", "content": task}]
        for task in grounded["tasks"]
    ]
    encoded = [tokenizer.encode(tokenizer.apply_chat_template(c)) for c in conversations]
    n = len(chat["conversations"])
    return {"chat": encoded[:n], "grounded": encoded[n:]}


def decode_run(engine: Engine, prompts: list[list[int]], params: SamplingParams, batch: int):
    """Outputs, and (decode-step tokens, decode-step seconds) over groups of `batch` prompts."""
    outputs: list[list[int]] = []
    tokens, seconds = 0, 0.0
    for start in range(0, len(prompts), batch):
        ids = [engine.add_request(p, params) for p in prompts[start : start + batch]]
        got: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_work:
            sched = engine.scheduler
            prefill = bool(sched.waiting) or any(s.num_pending_tokens > 1 for s in sched.running)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            emitted = 0
            for out in outs:
                got[out.request_id].extend(out.new_token_ids)
                emitted += len(out.new_token_ids)
            if not prefill:
                tokens += emitted
                seconds += dt
        outputs += [got[i] for i in ids]
    return outputs, tokens, seconds


def interleaved_runs(
    engines: dict[str, Engine], prompts: list[list[int]], params: SamplingParams, batch: int
) -> dict[str, tuple[list[list[int]], int, float]]:
    """Per method: outputs, and decode tokens and seconds summed over its runs. The methods
    take turns on each group of `batch` prompts (the order reversed every other group), and
    a set that is a single group is run SINGLE_GROUP_ROUNDS times: this VM's speed drifts
    by 20-30% over tens of seconds, which method-after-method timing turned into
    differences between methods."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    rounds = SINGLE_GROUP_ROUNDS if len(groups) == 1 else 1
    outputs: dict[str, list[list[int]]] = {m: [] for m in engines}
    tokens = dict.fromkeys(engines, 0)
    seconds = dict.fromkeys(engines, 0.0)
    turn = 0
    for round_ in range(rounds):
        for group in groups:
            order = list(engines) if turn % 2 == 0 else list(reversed(engines))
            turn += 1
            for method in order:
                outs, n, dt = decode_run(engines[method], group, params, batch)
                if round_ == 0:
                    outputs[method] += outs
                tokens[method] += n
                seconds[method] += dt
    return {m: (outputs[m], tokens[m], seconds[m]) for m in engines}


def run(
    weights: str = "fp32",
    model_path: str | None = None,
    threads: int = 2,
    quick: bool = False,
    k: int = 8,
    prompts_per_set: int | None = None,
    max_tokens: int | None = None,
    draft_path: str | None = None,
    head_path: str | None = None,
    head_minutes: float = HEAD_MINUTES,
    methods: tuple[str, ...] = METHODS,
    sets_wanted: tuple[str, ...] = SETS,
    log: Callable[[str], None] = print,
    head_tuning: dict[str, float] | None = None,
) -> dict:
    """``quick``: 4 prompts per set, 32 new tokens; the last two override (smoke tests).
    ``head_path``: the head for method `head`; None trains one on the replayed traffic
    (``head_minutes`` CPU minutes) and reports how under `head_training`. Where a head is
    measured, `adaptive` drafts with it too (it is the draft a pool would be given), with
    n-gram guesses merged into its trees; `draft` stays the distilled standalone draft.
    ``head_tuning``: the head's tree and cutoffs by EngineConfig field (else the engine's
    defaults)."""
    tuning = dict(head_tuning or {})
    tuned = EngineConfig(**tuning)  # type: ignore[arg-type]
    if "none" not in methods:
        methods = ("none", *methods)  # every speedup divides by it
    torch.set_num_threads(threads)
    path = model_path or default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    # `auto` measures which formats are fastest here, as a serving pool does at load.
    kv_dtype = resolve_kv_dtype(EngineConfig().kv_cache_dtype)[0]
    model, choice = load_serving_model(path, weights, threads=threads, kv_dtype=kv_dtype)
    checkpoint = read_checkpoint(path)  # fp32 tensors, for training the head
    # The replay's KV room holds a full batch of multi-turn conversations (64 x ~600 tokens).
    replay = Engine(
        EngineConfig(model=path, weights=weights, kv_cache_bytes=2 << 30, num_threads=threads),  # type: ignore[arg-type]
        model=model,
        tokenizer=tokenizer,
    )
    reply_tokens = 32 if quick else 64
    earlier: list[tuple[list[int], list[int]]] = []
    sets = load_prompt_sets(tokenizer, replay, reply_tokens=reply_tokens, earlier=earlier)
    sets = {name: prompts for name, prompts in sets.items() if name in sets_wanted}
    head_info = None
    if "head" in methods and head_path is None:
        folder = BENCH_HEADS.expanduser()
        log_path = folder / f"{Path(path).stem}.replay-log.jsonl"
        replayed = write_replay_log(
            log_path,
            replay,
            tokenizer,
            Path(path).stem,
            earlier,
            # Longer than the timed history's replies: more of what a head learns from,
            # cheap at the replay's batch size (the timed prompts do not change).
            32 if quick else 128,
            24 if quick else None,
            32 if quick else 160,
            # Two more turns per persona conversation: the timed chat replies are third turns.
            1 if quick else 2,
        )
        log(f"[bench] {replayed[0]} replayed turns logged to {log_path} in {replayed[1]:.0f} s")
        head = train_bench_head(
            checkpoint, tokenizer, log_path, folder / f"{Path(path).stem}.head.pt",
            head_minutes, replayed, log, model,
        )  # fmt: skip
        head_path, head_info = str(head.path), head.as_json()
    del replay
    max_tokens = max_tokens or (32 if quick else 96)
    per_set = prompts_per_set or (4 if quick else None)
    if per_set:
        sets = {name: prompts[:per_set] for name, prompts in sets.items()}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result: dict = {
        "weights": weights,
        "formats": choice.describe() if choice is not None else weights,
        "threads": threads,
        "max_tokens": max_tokens,
        "num_speculative_tokens": k,
        "draft_tree_width": tuned.draft_tree_width,
        "draft_min_confidence": tuned.draft_min_confidence,
        "draft_tree_min_confidence": tuned.draft_tree_min_confidence,
        "draft_tree_max_batch": tuned.draft_tree_max_batch,
        "sets": {},
        "acceptance_histograms": {},
    }
    if head_info is not None:
        result["head_training"] = head_info
    elif head_path is not None and "head" in methods:
        stats = read_head(head_path, tokenizer.fingerprint, checkpoint.config.vocab_size).stats
        size = Path(head_path).stat().st_size
        result["head_training"] = {"path": head_path, "size_bytes": size, "stats": stats}
    for set_name, prompts in sets.items():
        for batch in BATCHES:
            engines = {}
            for method in methods:
                uses_head = method == "head" or (method == "adaptive" and head_path is not None)
                config = EngineConfig(
                    model=path,
                    weights=weights,  # type: ignore[arg-type]
                    kv_cache_bytes=256 << 20,
                    num_threads=threads,
                    speculative_method="draft" if method == "head" else method,  # type: ignore[arg-type]
                    num_speculative_tokens=k,
                    draft_path=head_path if uses_head else draft_path,
                    **tuning,  # type: ignore[arg-type]
                )
                engines[method] = Engine(config, model=model, tokenizer=tokenizer)
                warm = SamplingParams(temperature=0.0, max_tokens=8)
                decode_run(engines[method], prompts[:1], warm, 1)
            # Every row count a timed step can have is routed before the clock starts (fp32
            # weights, the head's too: see fp32_gemm), as a pool's first steps on this
            # machine would have done.
            settle_fp32_gemm(batch * (k + 1))
            timed = interleaved_runs(engines, prompts, params, batch)
            plain, plain_tokens, plain_seconds = timed["none"]
            plain_rate = plain_tokens / plain_seconds if plain_seconds else 0.0
            for method in methods:
                outputs, tokens, seconds = timed[method]
                stats = engines[method].spec_stats()
                rate = tokens / seconds if seconds else 0.0
                entry = {
                    "tok_s": round(rate, 2),
                    "mean_accepted": stats["mean_accepted"] if method != "none" else 1.0,
                    "speedup": round(rate / plain_rate, 3) if plain_rate else None,
                    "identical_greedy": outputs == plain,
                    "decode_tokens": tokens,
                    "plain_steps": stats["plain_steps"],
                    "verify_steps": stats["verify_steps"],
                }
                if "draft_unavailable" in stats:
                    entry["draft_unavailable"] = stats["draft_unavailable"]
                result["sets"].setdefault(set_name, {}).setdefault(method, {})[f"b{batch}"] = entry
                result[f"{set_name}.{method}.b{batch}"] = entry
                hist = result["acceptance_histograms"].setdefault(method, [0] * 17)
                for a, n in enumerate(stats["accepted_histogram"]):
                    hist[a] += n
    result["acceptance_histograms"].pop("none", None)
    return result


def table_rows(result: dict) -> list[tuple[str, object, object, object]]:
    """(key, tok/s, plain tok/s, speedup) per set/method/batch, mean accepted in the name."""
    rows = []
    for set_name, methods in result["sets"].items():
        for method, batches in methods.items():
            for batch, e in batches.items():
                plain = methods["none"][batch]["tok_s"]
                same = "" if e["identical_greedy"] else " NOT IDENTICAL"
                name = f"{set_name}.{method}.{batch} (acc {e['mean_accepted']:.2f}){same}"
                rows.append((name, e["tok_s"], plain, e["speedup"]))
    return rows


def write_plots(result: dict, directory: str | Path) -> list[Path]:
    from tools.bench.plots import write_spec_plots

    return write_spec_plots(result, directory)
