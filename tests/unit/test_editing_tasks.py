"""The editing-app traffic the bench replays into the head's training log: every template
times every passage, never one of the timed grounded texts."""

from __future__ import annotations

import json
from importlib import resources

from tools.bench.editing_tasks import TASKS_FILE, editing_conversations, with_typos


def _data(name: str) -> dict:
    return json.loads((resources.files("tools.bench") / "data" / name).read_text())


def test_every_template_meets_every_passage():
    data = _data(TASKS_FILE)
    conversations = editing_conversations()
    assert len(conversations) == len(data["instructions"]) * len(data["passages"])
    assert all(c[0] == {"role": "system", "content": data["system"]} for c in conversations)
    assert len({c[1]["content"] for c in conversations}) == len(conversations)
    # A limit of one template count still covers every template.
    firsts = [c[1]["content"].split(":")[0] for c in editing_conversations(8)]
    assert len(set(firsts)) == len(data["instructions"]) == 8


def test_no_passage_overlaps_the_timed_grounded_set():
    timed = _data("spec_prompts.json")["grounded"]["tasks"]
    timed_sentences = {s.strip() for task in timed for s in task.split("\n\n", 1)[-1].split(".")}
    for passage in _data(TASKS_FILE)["passages"]:
        sentences = {s.strip() for s in passage["text"].split(".") if s.strip()}
        assert not sentences & timed_sentences, passage["name"]
        assert passage["name"] in passage["text"]  # the replace-the-name template needs it


def test_typos_swap_letters_only_and_are_deterministic():
    text = _data(TASKS_FILE)["passages"][1]["text"]
    typed = with_typos(text, 1)
    assert typed == with_typos(text, 1) and typed != text
    pairs = list(zip(text.split(" "), typed.split(" "), strict=True))
    changed = [(a, b) for a, b in pairs if a != b]
    assert changed and all(sorted(a) == sorted(b) and a[0] == b[0] for a, b in changed)
