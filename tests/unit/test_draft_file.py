"""Draft files: round trip, and refusing missing, corrupt and mismatched drafts clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.tiny import TINY_CONFIG, tiny_checkpoint
from engine.speculative import draft_file
from engine.speculative.draft_file import DraftLoadError, draft_path_for, save_draft
from engine.speculative.draft_model import model_from_checkpoint
from engine.speculative.draft_proposer import load_draft_proposer
from engine.speculative.proposer import DraftRequest

V = TINY_CONFIG.vocab_size
FP = "a" * 64


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    vocab = torch.arange(100, 356)
    model = model_from_checkpoint(tiny_checkpoint(0), (1,), vocab)
    path = tmp_path_factory.mktemp("draft") / "tiny.draft.pt"
    return save_draft(path, model, vocab, FP, V, {"heldout_agreement": 0.5})


def test_saved_draft_loads_and_proposes_in_its_vocabulary(saved):
    proposer = load_draft_proposer(saved, FP, V)
    draft = proposer.propose([DraftRequest("r", [1, 2, 3, 400], 4)], [False])[0]
    assert len(draft.token_ids) == 4
    assert all(100 <= t < 356 for t in draft.token_ids)


def test_tokenizer_mismatch_names_both_fingerprints(saved):
    with pytest.raises(DraftLoadError) as err:
        load_draft_proposer(saved, "b" * 64, V)
    assert "a" * 16 in str(err.value) and "b" * 16 in str(err.value)


def test_vocab_size_mismatch_names_both_sizes(saved):
    with pytest.raises(DraftLoadError, match=rf"vocab {V}\).*vocab 49152"):
        load_draft_proposer(saved, FP, 49152)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(DraftLoadError, match="does not exist"):
        load_draft_proposer(tmp_path / "nope.draft.pt", FP, V)


def test_garbage_file_is_refused(tmp_path):
    bad = tmp_path / "bad.draft.pt"
    bad.write_bytes(b"not a torch file at all")
    with pytest.raises(DraftLoadError, match="not a readable draft file"):
        load_draft_proposer(bad, FP, V)


def test_truncated_file_is_refused(saved, tmp_path):
    cut = tmp_path / "cut.draft.pt"
    cut.write_bytes(saved.read_bytes()[:5000])
    with pytest.raises(DraftLoadError, match="not a readable draft file"):
        load_draft_proposer(cut, FP, V)


def _rewrite(saved: Path, tmp_path: Path, **changes) -> Path:
    payload = torch.load(saved, weights_only=True)
    for key, value in changes.items():
        if value is None:
            payload.pop(key)
        else:
            payload[key] = value
    out = tmp_path / "changed.draft.pt"
    torch.save(payload, out)
    return out


def test_wrong_version_missing_keys_and_bad_tensors_are_refused(saved, tmp_path):
    with pytest.raises(DraftLoadError, match="format version 99"):
        load_draft_proposer(_rewrite(saved, tmp_path, version=99), FP, V)
    with pytest.raises(DraftLoadError, match="lacks vocab_ids"):
        load_draft_proposer(_rewrite(saved, tmp_path, vocab_ids=None), FP, V)
    with pytest.raises(DraftLoadError, match="not a splitserve draft"):
        load_draft_proposer(_rewrite(saved, tmp_path, format="other"), FP, V)
    state = torch.load(saved, weights_only=True)["state_dict"]
    state["norm"] = torch.ones(3)
    with pytest.raises(DraftLoadError, match="corrupt draft file"):
        load_draft_proposer(_rewrite(saved, tmp_path, state_dict=state), FP, V)


def test_draft_path_rule(tmp_path, monkeypatch):
    model = tmp_path / "models" / "Tiny.Q4_1.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    beside = model.parent / "Tiny.Q4_1.draft.pt"
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    monkeypatch.setattr(draft_file, "BUNDLED_DRAFTS", bundled)
    assert draft_path_for(model) == beside  # nothing anywhere: where training would write
    (bundled / beside.name).write_bytes(b"x")
    assert draft_path_for(model) == bundled / beside.name
    beside.write_bytes(b"x")
    assert draft_path_for(model) == beside  # a trained draft wins over the shipped one
    monkeypatch.setattr(draft_file.os, "access", lambda *_: False)
    monkeypatch.setattr(draft_file, "CACHE_DIR", tmp_path / "cache")
    assert draft_file.trained_draft_path(model) == tmp_path / "cache" / beside.name


def test_shipped_draft_fits_the_bundled_model():
    from shared.modelfile.default import default_model_path
    from shared.tokenizer import Tokenizer

    model = default_model_path()
    shipped = draft_file.BUNDLED_DRAFTS / f"{Path(model).stem}.draft.pt"
    assert shipped.is_file(), f"the bundled model's draft is missing: {shipped}"
    tokenizer = Tokenizer.from_gguf(model)
    proposer = load_draft_proposer(shipped, tokenizer.fingerprint, tokenizer.vocab_size)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    )
    draft = proposer.propose([DraftRequest("r", prompt, 4)], [False])[0]
    assert len(draft.token_ids) == 4
