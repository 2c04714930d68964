"""Editing-app requests the bench replays into the draft head's training log: grounded-style
traffic, where the reply copies most of the given text (the timed `grounded` set's kind).

Each instruction template of data/spec_head_tasks.json is applied to each passage, so the
log holds as many requests as templates times passages. The passages are disjoint from the
timed grounded set (a test checks it): the head learns the *behaviour* of copying with small
edits, never the timed texts themselves.
"""

from __future__ import annotations

import json
import random
from importlib import resources

TASKS_FILE = "spec_head_tasks.json"


def with_typos(text: str, seed: int) -> str:
    """Swap two neighbouring inner letters in about one word in four (words of 5+ letters,
    at least one word per text), deterministically per seed: the misspelt input a
    fix-the-spelling request carries."""
    rng = random.Random(seed)
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w.rstrip(".,;:!?")) >= 5]
    chosen = [i for i in candidates if rng.random() < 0.25] or candidates[:1]
    for i in chosen:
        word = words[i]
        j = rng.randrange(1, len(word.rstrip(".,;:!?")) - 2)
        words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def editing_conversations(limit: int | None = None) -> list[list[dict[str, str]]]:
    """Chat messages (system + user) of every template x passage, passage by passage (so a
    `limit` of one template count or more still covers every template)."""
    data = json.loads((resources.files("tools.bench") / "data" / TASKS_FILE).read_text())
    system = {"role": "system", "content": data["system"]}
    out = []
    for n, passage in enumerate(data["passages"]):
        for template in data["instructions"]:
            fields = {**passage, "typos": with_typos(passage["text"], n)}
            out.append([system, {"role": "user", "content": template.format(**fields)}])
    return out[:limit]
