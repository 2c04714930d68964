"""`splitserve draft train`: distil a speculative-decoding draft model from the target."""

from __future__ import annotations

import argparse
import os
import sys

from services.commands.common import fail


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
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
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
    t.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    if not args.max_minutes > 0:
        return fail(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.threads < 1:
        return fail(f"--threads must be >= 1, got {args.threads}")
    if not 16 <= args.vocab_size <= 65536:
        return fail(f"--vocab-size must be in 16..65536, got {args.vocab_size}")
    if not args.lr > 0:
        return fail(f"--lr must be > 0, got {args.lr}")
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

    import torch

    from shared.model.loader import read_checkpoint
    from shared.modelfile.config import ModelFileError
    from shared.modelfile.default import default_model_path
    from shared.speculative.draft_data import DEFAULT_PROMPTS, PromptFileError, load_prompts
    from shared.speculative.draft_file import trained_draft_path
    from shared.speculative.draft_train import TrainConfig, train_draft
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
        lr=args.lr,
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
    """`--from-log`: the target's states are recomputed from the logged token ids."""
    import torch

    from shared.model.loader import read_checkpoint
    from shared.modelfile.config import ModelFileError
    from shared.modelfile.default import default_model_path
    from shared.speculative.head_file import trained_head_path
    from shared.speculative.head_train import HeadTrainConfig, train_head
    from shared.speculative.training_log import TrainingLogError, read_training_log
    from shared.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    try:
        path = args.model or default_model_path()
        checkpoint = read_checkpoint(path)
        tokenizer = None if os.path.isdir(path) else Tokenizer.from_gguf(path)
        turns = read_training_log(args.from_log, args.log_model)
    except (ModelFileError, TrainingLogError, FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    vocab = checkpoint.config.vocab_size
    conversations = [
        t.conversation for t in turns if max(t.prompt_token_ids + t.completion_token_ids) < vocab
    ]
    fingerprint = tokenizer.fingerprint if tokenizer else f"untokenized:{checkpoint.source}"
    out = args.out or trained_head_path(path)
    config = HeadTrainConfig(
        max_minutes=args.max_minutes, vocab_size=args.vocab_size, lr=args.lr, seed=args.seed
    )
    stop_ids = tokenizer.stop_token_ids if tokenizer else frozenset()
    _stderr(f"[head] {len(conversations)} logged conversations from {args.from_log}")
    try:
        report = train_head(checkpoint, conversations, out, fingerprint, stop_ids, config, _stderr)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    size_mb = report.path.stat().st_size / 1e6
    print(
        f"{report.path} ({size_mb:.1f} MB): held-out first-guess agreement "
        f"{report.initial_agreement:.3f} -> {report.heldout_agreement:.3f} after {report.steps} "
        f"steps on {report.train_tokens} reply tokens ({report.elapsed_s / 60:.1f} CPU-min)"
    )
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
