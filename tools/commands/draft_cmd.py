"""`splitserve draft train`: distil a speculative-decoding draft model from the target."""

from __future__ import annotations

import argparse
import os
import sys

from tools.commands.common import WEIGHT_FORMATS, fail
from tools.commands.head_tuning import add_head_tuning, head_tuning


def add_command(sub) -> None:
    p = sub.add_parser("draft", help="speculative-decoding draft models")
    draft_sub = p.add_subparsers(dest="draft_command", metavar="SUBCOMMAND", required=True)
    t = draft_sub.add_parser(
        "train",
        help="distil a small draft from the target's own replies (minutes of CPU)",
        description="The target writes replies to chat prompts; a 1-2 layer draft with a reduced "
        "vocabulary is trained to match its next-token distribution, then saved beside the "
        "model where the decode pool finds it. Progress goes to stderr.",
    )
    t.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    t.add_argument(
        "--weights",
        default="fp32",
        choices=("fp32",),
        help="the teacher's weight format (fp32: a draft distilled at fp32 serves every format)",
    )
    t.add_argument("--out", default=None, help="draft file (default: beside the model)")
    t.add_argument(
        "--prompts",
        default=None,
        help='JSONL of {"messages": [...]} or {"token_ids": [...]} (default: bundled set)',
    )
    t.add_argument(
        "--data",
        default=None,
        help="cache of the target's replies: reused when the file exists (no generation), "
        "written otherwise",
    )
    t.add_argument(
        "--max-minutes",
        type=float,
        default=10.0,
        help="budget in CPU minutes of this process (all threads together)",
    )
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW learning rate (default: the trainer's, 1e-3 for a draft, 3e-3 for a head)",
    )
    t.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    t.add_argument("--vocab-size", type=int, default=4096, help="draft vocabulary size")
    t.add_argument(
        "--layers",
        default=None,
        help="target layers to start from, e.g. 0,29 (default: first,last)",
    )
    t.add_argument("--max-new-tokens", type=int, default=160, help="reply length cap")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--from-log",
        default=None,
        metavar="LOG",
        help="train a draft head (one layer over the target's hidden states) on a training "
        "log the coordinator wrote (capture.training_log) instead of distilling from --prompts",
    )
    t.add_argument(
        "--log-model",
        default=None,
        help="with --from-log: use only records of this model id (default: every record)",
    )
    t.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="with --from-log: the head's training arithmetic (auto: time a step of each "
        "here and keep the faster; bf16 runs under autocast with fp32 master weights)",
    )
    t.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="with --from-log: stop after this many optimizer steps (the learning-rate "
        "schedule follows steps instead of CPU time: the same head on any machine, budget "
        "permitting)",
    )
    t.set_defaults(handler=run_train)
    g = draft_sub.add_parser(
        "gate",
        help="accept a new draft only if it beats the current one and no draft on replayed "
        "traffic, with identical greedy output",
        description="Replays the training log's held-out conversations greedy at each batch "
        "size with no draft, the current draft and the candidate; exit 0 when the candidate "
        "is accepted (and installed with --install), 1 when refused.",
    )
    g.add_argument("--candidate", required=True, help="the new draft (head or model) file")
    g.add_argument("--current", default=None, help="the draft in service (default: none)")
    g.add_argument("--from-log", required=True, metavar="LOG", help="the training log")
    g.add_argument("--log-model", default=None, help="use only records of this model id")
    g.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    _gate_options(g)
    g.add_argument("--install", default=None, help="on acceptance, copy the candidate here")
    g.add_argument("--json", default=None, help="write the verdict here")
    g.set_defaults(handler=run_gate)
    a = draft_sub.add_parser(
        "adapt",
        help="online adaptation: retrain the served head from the rolling training log, gate "
        "it, install it if it pays; every --every minutes, or --once",
        description="Each round, once the log has gained --min-new-turns turns, the head at "
        "--served goes on training on the log's latest --window-turns turns (a warm start: "
        "rounds add up), is replayed by the gate of `draft gate` on the held-out chats, and "
        "replaces the served file only if accepted (the pools' watchers swap it in between "
        "steps). Each round is a JSON line of SERVED.adapt.jsonl. Progress goes to stderr.",
    )
    a.add_argument("--from-log", required=True, metavar="LOG", help="the rolling training log")
    a.add_argument(
        "--served", required=True, help="the head file the decode pools watch (draft_path)"
    )
    a.add_argument("--log-model", default=None, help="use only records of this model id")
    a.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2)"
    )
    a.add_argument(
        "--every", type=float, default=60.0, help="minutes between rounds (without --once)"
    )
    a.add_argument("--once", action="store_true", help="one round (if due), then exit")
    a.add_argument(
        "--min-new-turns", type=int, default=200, help="turns logged since the last round"
    )
    a.add_argument(
        "--window-turns", type=int, default=20_000, help="train on the log's latest turns only"
    )
    a.add_argument(
        "--fresh", action="store_true", help="start from the target, not the served head"
    )
    a.add_argument(
        "--max-minutes", type=float, default=30.0, help="each round's training CPU minutes"
    )
    a.add_argument("--max-steps", type=int, default=None, help="each round's optimizer steps")
    a.add_argument(
        "--lr",
        type=float,
        default=None,
        help="AdamW peak learning rate (default: 1e-3 going on from the served head, 3e-3 fresh)",
    )
    a.add_argument(
        "--vocab-size", type=int, default=4096, help="head vocabulary (a fresh head only)"
    )
    a.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    a.add_argument("--seed", type=int, default=0)
    _gate_options(a)
    a.set_defaults(handler=run_adapt)


def _check_train_options(args: argparse.Namespace) -> str | None:
    """What is wrong with the training options `draft train` and `draft adapt` share."""
    if not args.max_minutes > 0:
        return f"--max-minutes must be > 0, got {args.max_minutes}"
    if args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if not 16 <= args.vocab_size <= 65536:
        return f"--vocab-size must be in 16..65536, got {args.vocab_size}"
    if args.lr is not None and not args.lr > 0:
        return f"--lr must be > 0, got {args.lr}"
    if args.max_steps is not None and args.max_steps < 1:
        return f"--max-steps must be >= 1, got {args.max_steps}"
    return None


def run_train(args: argparse.Namespace) -> int:
    if problem := _check_train_options(args):
        return fail(problem)
    if args.max_new_tokens < 1:
        return fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    layers = None
    if args.layers:
        try:
            layers = tuple(int(x) for x in args.layers.split(","))
        except ValueError:
            return fail(f"--layers must be comma-separated layer numbers, got {args.layers!r}")

    if args.from_log:
        return run_train_head(args)
    if args.max_steps is not None:
        return fail("--max-steps applies to a head trained --from-log")

    import torch

    from engine.model.loader import read_checkpoint
    from engine.speculative.draft_data import DEFAULT_PROMPTS, PromptFileError, load_prompts
    from engine.speculative.draft_file import trained_draft_path
    from engine.speculative.draft_train import TrainConfig, train_draft
    from shared.modelfile.config import ModelFileError
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    try:
        path = args.model or default_model_path()
        checkpoint = read_checkpoint(path)
        tokenizer = None if os.path.isdir(path) else Tokenizer.from_gguf(path)
        prompts = load_prompts(args.prompts or DEFAULT_PROMPTS, tokenizer)
    except (ModelFileError, PromptFileError, FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    if tokenizer is not None and tokenizer.vocab_size != checkpoint.config.vocab_size:
        return fail(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
            f"{checkpoint.config.vocab_size}"
        )
    # A HF folder carries no tokenizer we read; its drafts are keyed to the model file instead.
    fingerprint = tokenizer.fingerprint if tokenizer else f"untokenized:{checkpoint.source}"
    out = args.out or trained_draft_path(path)
    config = TrainConfig(
        max_minutes=args.max_minutes,
        draft_vocab_size=args.vocab_size,
        source_layers=layers,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        lr=args.lr or TrainConfig().lr,
    )
    stop_ids = tokenizer.stop_token_ids if tokenizer else frozenset()
    try:
        report = train_draft(
            checkpoint, prompts, out, fingerprint, stop_ids, config, _stderr, args.data
        )
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    size_mb = report.path.stat().st_size / 1e6
    print(
        f"{report.path} ({size_mb:.1f} MB): held-out top-1 agreement "
        f"{report.heldout_agreement:.3f} after {report.steps} steps on "
        f"{report.train_tokens} reply tokens"
    )
    return 0


def run_train_head(args: argparse.Namespace) -> int:
    """`--from-log`: the target's states are recomputed from the logged token ids, by the
    model's fp32 prompt path, which computes a prefix a later turn resends only once."""
    import torch

    from engine.speculative.head_file import trained_head_path

    torch.set_num_threads(args.threads)
    try:
        path, checkpoint, tokenizer, turns = _target_and_log(args)
    except ValueError as exc:
        return fail(str(exc))
    _stderr(f"[head] {len(turns)} logged conversations from {args.from_log}")
    train = _head_trainer(args, checkpoint, tokenizer)
    try:
        report = train([t.conversation for t in turns], None, args.out or trained_head_path(path))
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    size_mb = report.path.stat().st_size / 1e6
    print(
        f"{report.path} ({size_mb:.1f} MB): held-out first-guess agreement "
        f"{report.initial_agreement:.3f} -> {report.heldout_agreement:.3f} after {report.steps} "
        f"steps on {report.train_tokens} reply tokens ({report.elapsed_s / 60:.1f} CPU-min, "
        f"{report.extra['precision']})"
    )
    return 0


def _head_trainer(args: argparse.Namespace, checkpoint, tokenizer):
    """(conversations, head to go on from or None, out path) -> HeadTrainReport, with the
    serving fp32 model built once (a round of `draft adapt` reuses it)."""
    from engine.model.llama import LlamaModel
    from engine.speculative.head_train import HeadTrainConfig, train_head

    vocab = checkpoint.config.vocab_size
    fingerprint = tokenizer.fingerprint if tokenizer else f"untokenized:{checkpoint.source}"
    config = HeadTrainConfig(
        max_minutes=args.max_minutes,
        vocab_size=args.vocab_size,
        lr=args.lr or HeadTrainConfig().lr,
        # An explicit --lr is every run's; otherwise a continued head gets its own default.
        lr_continued=args.lr or HeadTrainConfig().lr_continued,
        seed=args.seed,
        precision=args.precision,
        max_steps=args.max_steps,
        heldout_fraction=getattr(args, "heldout_fraction", HeadTrainConfig().heldout_fraction),
    )
    stop_ids = tokenizer.stop_token_ids if tokenizer else frozenset()
    serving = LlamaModel(checkpoint, weights="fp32")

    def train(conversations, init, out):
        usable = [(ids, p) for ids, p in conversations if max(ids) < vocab]
        return train_head(
            checkpoint, usable, out, fingerprint, stop_ids, config, _stderr, serving, init=init
        )

    return train


def run_adapt(args: argparse.Namespace) -> int:
    batches = _check_gate_options(args)
    if isinstance(batches, str):
        return fail(batches)
    if problem := _check_train_options(args):
        return fail(problem)
    if not args.every > 0:
        return fail(f"--every must be > 0 minutes, got {args.every}")
    if args.heldout_fraction >= 1.0:
        return fail("--heldout-fraction must be < 1: adaptation needs chats to train on")
    from tools.bench.draft_adapt import AdaptPolicy

    try:
        policy = AdaptPolicy(args.min_new_turns, args.window_turns, args.fresh)
    except ValueError as exc:
        return fail(
            str(exc)
            .replace("min_new_turns", "--min-new-turns")
            .replace("window_turns", "--window-turns")
        )

    import signal
    import threading
    from pathlib import Path

    import torch

    from engine.speculative.draft_file import DraftLoadError
    from engine.speculative.head_file import read_head
    from shared.training_log import read_training_log
    from tools.bench.draft_adapt import due, history_path, read_history, run_round

    torch.set_num_threads(args.threads)
    served = Path(args.served).expanduser()
    try:
        path, checkpoint, tokenizer, _ = _target_and_log(args)
    except ValueError as exc:
        return fail(str(exc))
    fingerprint = tokenizer.fingerprint if tokenizer else f"untokenized:{checkpoint.source}"
    vocab = checkpoint.config.vocab_size
    train = _head_trainer(args, checkpoint, tokenizer)
    replay = _replay_gate(args, batches, path, checkpoint, tokenizer)

    def read_served(where: Path):
        if not where.is_file():
            return None, f"{where} does not exist yet"
        try:
            return read_head(where, fingerprint, vocab), ""
        except DraftLoadError as exc:
            return None, str(exc)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        # Between rounds: a round in progress finishes (or is killed with the process; the
        # served file is only ever replaced whole, so nothing half-written is left behind).
        signal.signal(signum, lambda *_: stop.set())
    while True:
        try:
            turns = read_training_log(args.from_log, args.log_model)
            go, why = due(len(turns), read_history(history_path(served)), policy)
            _stderr(f"[adapt] {'round' if go else 'no round'}: {why}")
            if go:

                def gate(candidate, current, turns=turns):
                    return replay(candidate, current, turns)

                record = run_round(
                    [t.conversation for t in turns], served, train, gate, read_served, policy,
                    _stderr,
                )  # fmt: skip
                verdict = "ACCEPTED" if record["accepted"] else "REFUSED"
                print(
                    f"{verdict}: {'; '.join(record['reasons'])} (held-out agreement "
                    f"{record['initial_agreement']:.3f} -> {record['heldout_agreement']:.3f}, "
                    f"{record['steps']} steps, {record['train_cpu_s'] / 60:.1f} CPU-min)",
                    flush=True,
                )
        except (ValueError, OSError) as exc:
            if args.once:
                return fail(str(exc))
            _stderr(f"[adapt] round failed, the served head is unchanged: {exc}")
        if args.once or stop.wait(args.every * 60.0):
            return 0


def _gate_options(g) -> None:
    """What `draft gate` and `draft adapt` replay, and how strictly they judge."""
    g.add_argument(
        "--weights",
        default="fp32",
        choices=WEIGHT_FORMATS,
        help="weight format the pool serves (auto: time the eligible formats here and serve "
        "the fastest, as a pool does at load)",
    )
    g.add_argument("--batches", default="1,8", help="production batch sizes, comma-separated")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=8, dest="k")
    g.add_argument(
        "--method",
        default="adaptive",
        choices=("adaptive", "draft"),
        help="how the pool drafts with it (speculative.method): adaptive prices each step's "
        "drafts from measured step costs and takes n-gram guesses too; draft always drafts "
        "with the head alone",
    )
    add_head_tuning(g)
    g.add_argument("--max-tokens", type=int, default=64, help="reply length replayed")
    g.add_argument("--max-prompts", type=int, default=16, help="held-out prompts replayed")
    g.add_argument("--heldout-fraction", type=float, default=0.1, help="as the trainer's")
    g.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    g.add_argument(
        "--min-gain",
        type=float,
        default=None,
        help="the fraction by which the candidate's tokens/s must beat each rival's "
        "(default: the gate's, 0.03: smaller edges are within a replay's noise)",
    )


def _check_gate_options(args: argparse.Namespace) -> tuple[int, ...] | str:
    """The batch sizes, or what is wrong with the options."""
    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        return f"--batches must be comma-separated sizes, got {args.batches!r}"
    if not batches or min(batches) < 1 or args.max_prompts < 1 or args.max_tokens < 1:
        return "--batches, --max-prompts and --max-tokens must be >= 1"
    if args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if not 1 <= args.k <= 16:
        return f"--num-speculative-tokens must be in 1..16, got {args.k}"
    if isinstance(tuning := head_tuning(args), str):
        return tuning
    if not 0.0 < args.heldout_fraction <= 1.0:
        return f"--heldout-fraction must be in (0, 1], got {args.heldout_fraction}"
    # None: the gate's own default, read from its module (imported late: it loads torch).
    if args.min_gain is not None and not 0.0 <= args.min_gain < 1.0:
        return f"--min-gain must be in [0, 1), got {args.min_gain}"
    return batches


def _replay_gate(args: argparse.Namespace, batches: tuple[int, ...], path, checkpoint, tokenizer):
    """(candidate, current, logged turns) -> the gate's verdict on the turns' held-out chats,
    on weights loaded once. ValueError when there is no held-out chat to replay."""
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from engine.model.llama import LlamaModel
    from shared.training_log import split_heldout
    from tools.bench.draft_gate import DEFAULT_MIN_GAIN, gate

    if args.weights == "auto":
        from engine.core.model_setup import load_serving_model

        model, _ = load_serving_model(path, "auto", threads=args.threads)
    else:
        model = LlamaModel(checkpoint, weights=args.weights)
    salt = None if tokenizer else f"untokenized:{checkpoint.source}".encode()

    # The pool's tree and cutoffs where given: a head's speed depends on them.
    pool = head_tuning(args)
    assert not isinstance(pool, str)  # checked with the other options

    def make_engine(draft: str | None) -> Engine:
        config = EngineConfig(
            **pool,
            model=path,
            weights=args.weights,
            kv_cache_bytes=256 << 20,
            num_threads=args.threads,
            speculative_method=args.method if draft else "none",
            num_speculative_tokens=args.k,
            draft_path=draft,
        )
        return Engine(config, model=model, tokenizer=tokenizer, kv_salt=salt)

    def replay(candidate, current, turns):
        held_chats, _ = split_heldout([t.conversation for t in turns], args.heldout_fraction)
        held = {tuple(ids[:prompt_len]) for chat in held_chats for ids, prompt_len in chat}
        prompts = [t.prompt_token_ids for t in turns if tuple(t.prompt_token_ids) in held]
        prompts = prompts[: args.max_prompts]
        if not prompts:
            raise ValueError(f"{args.from_log}: no held-out conversations to replay")
        _stderr(f"[gate] replaying {len(prompts)} held-out prompts at batch sizes {batches}")
        min_gain = DEFAULT_MIN_GAIN if args.min_gain is None else args.min_gain
        verdict = gate(
            make_engine,
            prompts,
            str(candidate),
            None if current is None else str(current),
            batches,
            args.max_tokens,
            min_gain,
        )
        for name, run in verdict.as_json()["runs"].items():
            _stderr(f"[gate] {name}: {run}")
        return verdict

    return replay


def run_gate(args: argparse.Namespace) -> int:
    batches = _check_gate_options(args)
    if isinstance(batches, str):
        return fail(batches)

    import json

    import torch

    from tools.bench.draft_gate import install

    torch.set_num_threads(args.threads)
    try:
        path, checkpoint, tokenizer, turns = _target_and_log(args)
        replay = _replay_gate(args, batches, path, checkpoint, tokenizer)
        verdict = replay(args.candidate, args.current, turns)
    except ValueError as exc:
        return fail(str(exc))
    report = verdict.as_json()
    if verdict.accepted and args.install:
        report["installed"] = str(install(args.candidate, args.install))
    print(("ACCEPTED: " if verdict.accepted else "REFUSED: ") + "; ".join(verdict.reasons))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if verdict.accepted else 1


def _target_and_log(args: argparse.Namespace):
    """(model path, checkpoint, tokenizer or None, logged turns); ValueError says what failed."""
    from engine.model.loader import read_checkpoint
    from shared.modelfile.config import ModelFileError
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer
    from shared.training_log import TrainingLogError, read_training_log

    try:
        path = args.model or default_model_path()
        checkpoint = read_checkpoint(path)
        tokenizer = None if os.path.isdir(path) else Tokenizer.from_gguf(path)
        turns = read_training_log(args.from_log, args.log_model)
    except (ModelFileError, TrainingLogError, FileNotFoundError) as exc:
        raise ValueError(str(exc)) from None
    return path, checkpoint, tokenizer, turns


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
