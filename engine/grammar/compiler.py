"""Structured-output specs compiled to grammars, cached per schema.

The engine is llguidance (not xgrammar), because:
- it installs alone: no dependencies, one abi3 wheel; xgrammar needs torch, transformers and
  a TVM FFI package at run time, and transformers is only a test dependency here;
- a grammar is built lazily, one token trie per tokenizer shared by all grammars: starting a
  matcher for a new JSON schema costs about a millisecond, where xgrammar precompiles
  per-state token masks up front (tens to hundreds of ms per new schema on this CPU), which
  every first request of a schema would pay in its time to first token;
- it has what speculation needs (masks along a draft, `validate_tokens`, `rollback`), and its
  JSON-schema compiler refuses unsupported keywords by name (`Unimplemented keys: ["if"]`),
  which becomes the client's 400 as is.

The cache holds one pristine matcher per (kind, schema text); a request gets a deep copy, so
a schema compiles once however many requests use it. It is bounded (least recently used
goes first) and thread-safe: the worker compiles a new schema off the engine thread (see
`AsyncEngine.generate`), the engine thread copies it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance

from engine.grammar.state import GrammarState
from engine.grammar.vocabulary import grammar_vocabulary
from shared.sampling.structured import StructuredOutput
from shared.tokenizer.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 256
# `json_object`: any JSON object, as OpenAI's JSON mode promises.
_ANY_OBJECT = '{"type":"object"}'
# Compact JSON: no whitespace between tokens. With flexible whitespace a small model can pad
# forever ("\n\n\n..."), and nothing after the closing brace is possible, so the grammar
# finishes the output itself the moment the value is complete.
_JSON_OPTIONS: dict = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The spec cannot be compiled (invalid, or uses what the grammar engine does not
    implement); the message names the keyword."""


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, cache_size: int = DEFAULT_CACHE_SIZE):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocabulary = grammar_vocabulary(tokenizer)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine matcher for `spec` (cached); raises GrammarError."""
        key = spec.grammar_key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached
        # Outside the lock: a large schema may take a while (llguidance drops the GIL), and
        # two threads compiling the same new schema at once is only wasted work.
        matcher = self._build(spec)
        with self._lock:
            self.misses += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def start(self, spec: StructuredOutput, request_id: str = "") -> GrammarState:
        """A fresh state at the grammar's start, for one request."""
        return GrammarState(self.compile(spec).deep_copy(), request_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cached": len(self._cache), "hits": self.hits, "misses": self.misses}

    def _build(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        schema = spec.schema if spec.kind == "json_schema" else _ANY_OBJECT
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the schema cannot be compiled: {exc}") from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.vocabulary
        )
        if is_error:
            raise GrammarError(f"the schema is not supported: {messages[0]}")
        matcher = llguidance.LLMatcher(self.vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the schema is not supported: {matcher.get_error()}")
        return matcher
