"""`splitserve generate`: stream a chat reply to the terminal from a single in-process engine."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from tools.commands.common import add_model_args, fail


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
    from engine.core.config import EngineConfig
    from engine.core.engine import Engine
    from services.coordinator.generation_backend import BackendRequestError
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
        tokenizer = Tokenizer.from_model_path(path) if _has_tokenizer(path) else None
        engine = Engine(
            EngineConfig(model=path, weights=args.weights, num_threads=args.threads),
            tokenizer=tokenizer,
        )
    except (ModelFileError, ValueError, FileNotFoundError) as exc:
        return fail(str(exc))
    if tokenizer is None:
        return fail("generate needs the model's tokenizer: a GGUF, or a folder's tokenizer.json")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    try:
        n, reason, first, total = asyncio.run(_stream(engine, tokenizer, prompt_ids, params))
    except BackendRequestError as exc:
        return fail(f"{exc.param}: {exc.message}")
    decode_rate = (n - 1) / (total - first) if n > 1 and first is not None else 0.0
    print(
        f"\n[{n} tokens, finish_reason={reason}, ttft {1000 * (first or 0):.0f} ms, "
        f"{decode_rate:.1f} tok/s decode, weights={args.weights}]",
        file=sys.stderr,
    )
    return 0


async def _stream(engine, tokenizer, prompt_ids: list[int], params):
    """Writes the reply as it comes; (tokens, finish reason, ttft s, total s).

    Through the in-process backend and the coordinator's retry loop, which makes the text:
    stop strings and detokenizing behave here exactly as they do behind the API."""
    from services.coordinator.attempt.retry import RetryLoop
    from services.coordinator.generation_backend import GenerationRequest
    from services.coordinator.route.targets import RetryPolicy
    from tools.inprocess.engine_backend import EngineBackend

    req = GenerationRequest(
        request_id="generate",
        model="local",
        prompt_token_ids=prompt_ids,
        params=params,
        priority=1,
        service_tier="default",
    )
    start = time.perf_counter()
    first, n, reason = None, 0, None
    with EngineBackend(engine, model_id="local", tokenizer=tokenizer) as backend:
        loop = RetryLoop(backend, RetryPolicy(models=["local"]), tokenizer)
        async for chunk in loop.generate(req):
            if first is None:
                first = time.perf_counter() - start
            n = chunk.num_output_tokens
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            reason = chunk.finish_reason or reason
    return n, reason, first, time.perf_counter() - start


def _has_tokenizer(path: str) -> bool:
    """A GGUF carries its tokenizer; a Hugging Face folder, if it has tokenizer.json."""
    import os

    return not os.path.isdir(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))
