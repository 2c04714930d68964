"""On the real SmolLM2: greedy output with every speculative method, at batch 1 and 8, equals
plain decoding token for token (short outputs to stay fast)."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.speculative.draft_file import draft_path_for
from engine.speculative.draft_model import model_from_checkpoint
from engine.speculative.draft_proposer import ModelDraftProposer, load_draft_proposer
from shared.sampling.params import SamplingParams
from tests.spec_helpers import pin_step_costs
from tools.bench.spec_bench import load_prompt_sets

PARAMS = SamplingParams(temperature=0.0, max_tokens=32)
B1_PROMPTS = 2


@pytest.fixture(scope="module")
def prompts(real_tokenizer) -> list[list[int]]:
    sets = load_prompt_sets(real_tokenizer)
    return sets["grounded"][:4] + sets["chat"][:4]


@pytest.fixture(scope="module")
def draft_factory(real_checkpoint, gguf_path, real_tokenizer):
    """A trained draft if one sits at the default location, else one initialised from two of
    the target's layers (untrained: it exercises rejections as much as acceptances)."""

    vocab = real_checkpoint.config.vocab_size
    path = draft_path_for(gguf_path)

    def make():
        if path.is_file():
            return load_draft_proposer(path, real_tokenizer.fingerprint, vocab)
        layers = (0, real_checkpoint.config.num_layers - 1)
        ids = torch.arange(vocab)
        model = model_from_checkpoint(real_checkpoint, layers, ids).eval()
        return ModelDraftProposer(model, ids, vocab)

    return make


def _run(model, tokenizer, method, prompts, batch, draft=None) -> tuple[list[list[int]], dict]:
    config = EngineConfig(
        kv_cache_bytes=64 << 20, speculative_method=method, num_speculative_tokens=4
    )
    engine = Engine(config, model=model, tokenizer=tokenizer, draft=draft)
    pin_step_costs(engine)
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += engine.generate(prompts[i : i + batch], PARAMS)
    engine.blocks.check_integrity()
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
    return outputs, engine.spec_stats()


@pytest.fixture(scope="module")
def plain(real_model, real_tokenizer, prompts):
    b8, _ = _run(real_model, real_tokenizer, "none", prompts, 8)
    b1, _ = _run(real_model, real_tokenizer, "none", prompts[:B1_PROMPTS], 1)
    return {1: b1, 8: b8}


@pytest.mark.parametrize("method", ["ngram", "draft", "adaptive"])
def test_greedy_equals_plain_decoding(
    real_model, real_tokenizer, prompts, plain, method, draft_factory
):
    for batch, subset in ((8, prompts), (1, prompts[:B1_PROMPTS])):
        draft = draft_factory() if method in ("draft", "adaptive") else None
        outputs, stats = _run(real_model, real_tokenizer, method, subset, batch, draft)
        assert outputs == plain[batch], f"{method} at batch {batch}"
        # With step costs pinned, an adaptive that never speculates fails here too.
        assert stats["verify_steps"] > 0, f"{method} at batch {batch} never speculated"


def test_bench_spec_serves_auto_weights_as_a_pool_does():
    """`bench spec --weights auto` measures the formats `auto` chooses here (it used to hand
    'auto' to the model loader, which refused it with a traceback)."""
    from tools.bench import spec_bench

    result = spec_bench.run(
        weights="auto",
        quick=True,
        methods=("none", "ngram"),
        sets_wanted=("chat",),
        prompts_per_set=1,
        max_tokens=4,
        log=lambda _: None,
    )
    assert result["weights"] == "auto"
    assert result["formats"].startswith("prefill=")  # what auto chose, said
    entry = result["chat.ngram.b1"]
    # A set that is one group is run in several rounds (the methods' turns alternate), each
    # decoding 3 tokens after the prompt's first.
    rounds = spec_bench.SINGLE_GROUP_ROUNDS
    assert entry["identical_greedy"] and entry["decode_tokens"] == 3 * rounds
