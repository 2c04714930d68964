"""`splitserve generate`: stream a chat reply to the terminal from a single in-process engine."""

from __future__ import annotations

import argparse
import sys
import time

from services.commands.common import add_model_args, fail


def add_command(sub) -> None:
    p = sub.add_parser("generate", help="stream a chat reply to the terminal")
    p.add_argument("prompt", nargs="?", default="Tell me a short story about a lighthouse.")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_model_args(p, default_weights="auto")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shared.engine.config import EngineConfig
    from shared.engine.engine import Engine, RequestError
    from shared.modelfile.config import ModelFileError
    from shared.modelfile.default import default_model_path
    from shared.sampling.params import SamplingParamError, SamplingParams
    from shared.tokenizer import Tokenizer

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            stop=tuple(args.stop),
        )
    except SamplingParamError as exc:
        return fail(str(exc))
    try:
        path = args.model or default_model_path()
        tokenizer = Tokenizer.from_gguf(path) if not _is_dir(path) else None
        engine = Engine(
            EngineConfig(model=path, weights=args.weights, num_threads=args.threads),
            tokenizer=tokenizer,
        )
    except (ModelFileError, ValueError, FileNotFoundError) as exc:
        return fail(str(exc))
    if tokenizer is None:
        return fail("generate needs a GGUF model (its tokenizer is read from the file)")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    try:
        engine.add_request(prompt_ids, params)
    except RequestError as exc:
        return fail(f"{exc.param}: {exc}")
    start = time.perf_counter()
    first = None
    n = 0
    reason = None
    for out in engine.run_until_done():
        if first is None:
            first = time.perf_counter() - start
        n += len(out.new_token_ids)
        sys.stdout.write(out.text)
        sys.stdout.flush()
        reason = out.finish_reason or reason
    total = time.perf_counter() - start
    decode_rate = (n - 1) / (total - first) if n > 1 and first is not None else 0.0
    print(
        f"\n[{n} tokens, finish_reason={reason}, ttft {1000 * (first or 0):.0f} ms, "
        f"{decode_rate:.1f} tok/s decode, weights={args.weights}]",
        file=sys.stderr,
    )
    return 0


def _is_dir(path: str) -> bool:
    import os

    return os.path.isdir(path)
