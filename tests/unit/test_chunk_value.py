"""A stream chunk is a value: stages of the coordinator make changed copies of it, never
edit the one they were given."""

from __future__ import annotations

import dataclasses

import pytest

from shared.wire.records import GenerationChunk


def test_a_chunk_cannot_be_changed_in_place():
    chunk = GenerationChunk(token_ids=[1, 2], num_output_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.text = "changed"  # type: ignore[misc]


def test_with_changes_makes_a_copy_and_leaves_the_original_as_it_was():
    chunk = GenerationChunk(token_ids=[1, 2], num_output_tokens=2, metadata={"a": 1})
    changed = chunk.with_changes(text="hi", finished=True, finish_reason="stop")
    assert changed == GenerationChunk(
        token_ids=[1, 2],
        text="hi",
        finished=True,
        finish_reason="stop",
        num_output_tokens=2,
        metadata={"a": 1},
    )
    assert chunk.text == "" and not chunk.finished and chunk.finish_reason is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.text = "again"  # type: ignore[misc]


def test_a_change_to_a_field_a_chunk_does_not_have_is_refused():
    with pytest.raises(TypeError, match="no field"):
        GenerationChunk(token_ids=[]).with_changes(txet="typo")
