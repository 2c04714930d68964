"""The lm-evaluation-harness task file the project ships for PIQA asks what `splitserve eval`
scores in process: the same items, the same context, the same two continuations."""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml

from engine.quality.piqa import load_piqa

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "engine" / "quality" / "lm_eval" / "piqa_local.yaml"


def test_task_reads_the_bundled_items_with_the_harness_prompt():
    task = yaml.safe_load(TASK.read_text())
    data = ROOT / task["dataset_kwargs"]["data_files"]["validation"]
    assert data.exists()  # relative to the repository root, where the README runs lm_eval
    items = load_piqa()
    assert sum(1 for line in data.read_text().splitlines() if line.strip()) == len(items)
    env = jinja2.Environment()
    text = env.from_string(task["doc_to_text"])
    choices = env.from_string(task["doc_to_choice"])
    doc = {"goal": items[0].goal, "sol1": items[0].sol1, "sol2": items[0].sol2}
    assert text.render(**doc) == items[0].context
    rendered = choices.render(**doc)
    assert rendered == str([items[0].sol1, items[0].sol2])
    delimited = tuple(task["target_delimiter"] + c for c in (items[0].sol1, items[0].sol2))
    assert delimited == items[0].continuations
    assert task["output_type"] == "multiple_choice" and task["doc_to_target"] == "label"
