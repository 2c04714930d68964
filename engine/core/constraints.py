"""The engine's structured outputs: each request's grammar started (and, for a continuation,
rebuilt from the tokens it already has), and speculative drafts cut to what the grammar
allows before they are verified. The masks themselves are the runner's (`engine.grammar.masks`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq

from engine.core.errors import RequestError
from engine.core.sequence import Sequence
from engine.grammar.compiler import DEFAULT_CACHE_SIZE, GrammarCompiler, GrammarError
from engine.grammar.state import GrammarState
from engine.speculative.tree import main_chain
from shared.sampling.params import SamplingParams
from shared.sampling.structured import StructuredOutput
from shared.tokenizer.tokenizer import Tokenizer

PARAM = "response_format"


class OutputConstraints:
    def __init__(self, tokenizer: Tokenizer | None, cache_size: int = DEFAULT_CACHE_SIZE):
        # Workers' engines carry no tokenizer (text is the coordinator's), so the worker
        # hands this one its tokenizer; without one, structured requests are refused.
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (~0.1 s: the vocabulary's token trie); thread-safe."""
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise RequestError(
                        PARAM, "structured outputs need the model's tokenizer on this replica"
                    )
                self._compiler = GrammarCompiler(self.tokenizer, self.cache_size)
            return self._compiler

    def warm(self) -> None:
        """Build the grammar vocabulary now (a worker does it at startup, on a helper
        thread), so that the first structured request pays only for its own schema."""
        if self.tokenizer is not None:
            _ = self.compiler

    def compile(self, spec: StructuredOutput) -> None:
        """Compile (or find cached) `spec`'s grammar; safe off the engine thread."""
        try:
            self.compiler.compile(spec)
        except GrammarError as exc:
            raise RequestError(PARAM, str(exc)) from exc

    def start(
        self,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: Seq[int],
        emitted: Seq[int] = (),
    ) -> GrammarState | None:
        """The request's grammar state, past the tokens it already generated: the prompt's
        last `replay_tokens` (a continuation) and `emitted` (a first token sampled by the
        prefill replica)."""
        spec = params.structured
        if spec is None:
            return None
        if spec.replay_tokens > len(prompt_token_ids):
            raise RequestError(
                PARAM,
                f"replay_tokens ({spec.replay_tokens}) exceeds the prompt "
                f"({len(prompt_token_ids)} tokens)",
            )
        try:
            state = self.compiler.start(spec, request_id)
        except GrammarError as exc:
            raise RequestError(PARAM, str(exc)) from exc
        replayed = list(prompt_token_ids[len(prompt_token_ids) - spec.replay_tokens :])
        if not state.replay(replayed + list(emitted)):
            raise RequestError(
                PARAM,
                f"the {len(replayed) + len(emitted)} tokens this request already generated do "
                "not fit its schema; it cannot be continued here",
            )
        return state

    def stats(self) -> dict[str, int]:
        return self._compiler.stats() if self._compiler is not None else {}


def fit_drafts_to_grammar(running: list[Sequence]) -> None:
    """Cut each constrained sequence's draft at its first token the grammar refuses: a
    draft token that could never be emitted would only waste a verify slot."""
    for seq in running:
        draft = seq.draft
        if seq.grammar is None or draft is None or not len(draft):
            continue
        draft = seq.draft = main_chain(draft)  # a grammar follows one path: no trees here
        n = seq.grammar.valid_prefix(draft.token_ids)
        if n == len(draft):
            continue
        seq.draft = draft.prefix(n) if n else None
