"""Draft heads trained on the deployment's own traffic, in a cluster: the coordinators' training
log on a shared volume (a file per pod), heads on another that decode pods watch, and one
adaptation CronJob per model that drafts with a head."""

from __future__ import annotations

import argparse

import yaml

from shared.config import engine_defaults
from shared.config.schema import parse_config
from tests.chart.conftest import render
from tools.commands import draft_cmd

LOG_DIR = "/var/lib/splitserve/training-log"
DRAFT_DIR = "/var/lib/splitserve/drafts"


def _config(value_set: str):
    return parse_config(yaml.safe_load(render(value_set).config_yaml()))


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _mounts(spec: dict) -> dict[str, dict]:
    return {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}


def _claims(spec: dict) -> dict[str, str]:
    return {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    }


def _draft_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve")
    draft_cmd.add_command(parser.add_subparsers(dest="command"))
    return parser


def test_by_default_nothing_is_logged_and_no_job_trains():
    rendered = render("default")
    config = _config("default")
    assert config.capture.training_log.enabled is False
    assert not rendered.of_kind("CronJob")
    assert all(m.speculative.method == "none" for m in config.models)
    assert "training-log" not in _mounts(
        _pod(rendered.get("Deployment", "rel-splitserve-coordinator"))
    )


def test_each_coordinator_pod_logs_to_its_own_file_on_the_shared_volume():
    config = _config("draft-training")
    log = config.capture.training_log
    assert (log.enabled, log.sample_ratio) == (True, 0.25)
    # {host} is the pod's name: two coordinators never append to one file.
    assert log.path == f"{LOG_DIR}/{{host}}.jsonl"
    coordinator = _pod(render("draft-training").get("Deployment", "rel-splitserve-coordinator"))
    mount = _mounts(coordinator)["training-log"]
    assert mount["mountPath"] == LOG_DIR and not mount.get("readOnly")
    assert _claims(coordinator)["training-log"] == "splitserve-training-log"


def test_models_drafting_with_a_head_watch_it_on_the_drafts_volume():
    rendered = render("draft-training")
    models = {m.id: m for m in _config("draft-training").models}
    small, qwen, ngram = (
        models["SmolLM2-135M-Instruct"],
        models["qwen2.5-0.5b"],
        models["tiny-ngram"],
    )
    assert small.speculative.draft_path == f"{DRAFT_DIR}/smollm2-135m-instruct.head.pt"
    assert (small.speculative.method, small.speculative.num_speculative_tokens) == ("adaptive", 8)
    assert small.speculative.draft_tree_width == 2
    assert small.speculative.draft_tree_max_batch == 4
    assert qwen.speculative.draft_path == f"{DRAFT_DIR}/qwen2-5-0-5b.head.pt"
    assert ngram.speculative.draft_path is None and ngram.speculative.method == "ngram"
    for slug, watches in (
        ("smollm2-135m-instruct", True),
        ("qwen2-5-0-5b", True),
        ("tiny-ngram", False),
    ):
        decode = _pod(rendered.get("Deployment", f"rel-splitserve-{slug}-decode"))
        prefill = _pod(rendered.get("Deployment", f"rel-splitserve-{slug}-prefill"))
        assert "drafts" not in _mounts(prefill), slug  # prefill never drafts
        if watches:
            mount = _mounts(decode)["drafts"]
            assert mount["mountPath"] == DRAFT_DIR and mount["readOnly"] is True
            assert _claims(decode)["drafts"] == "splitserve-drafts"
        else:
            assert "drafts" not in _mounts(decode), slug


def test_one_adaptation_job_per_head_runs_a_command_line_draft_adapt_accepts():
    rendered = render("draft-training")
    config = _config("draft-training")
    served = {m.id: m.speculative.draft_path for m in config.models}
    jobs = rendered.of_kind("CronJob")
    assert sorted(j["metadata"]["name"] for j in jobs) == [
        "rel-splitserve-qwen2-5-0-5b-adapt",
        "rel-splitserve-smollm2-135m-instruct-adapt",
    ]
    parser = _draft_parser()
    seen = {}
    for job in jobs:
        assert job["spec"]["concurrencyPolicy"] == "Forbid"
        assert job["spec"]["schedule"] == "17 * * * *"
        spec = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        assert spec["restartPolicy"] == "Never"
        container = spec["containers"][0]
        args = parser.parse_args(container["args"])
        assert args.handler is draft_cmd.run_adapt and args.once
        # The problems the CLI would refuse to run with: none.
        assert draft_cmd._check_gate_options(args) == (1, 8)
        assert draft_cmd._check_train_options(args) is None
        assert args.from_log == LOG_DIR and args.served == served[args.log_model]
        assert (args.max_minutes, args.min_new_turns, args.window_turns) == (45, 200, 20000)
        mounts = _mounts(spec)
        assert mounts["training-log"]["readOnly"] is True
        assert mounts["drafts"]["mountPath"] == DRAFT_DIR and not mounts["drafts"].get("readOnly")
        assert _claims(spec) == {
            "training-log": "splitserve-training-log",
            "drafts": "splitserve-drafts",
            "models": "models",
        }
        seen[args.log_model] = args
    small, qwen = seen["SmolLM2-135M-Instruct"], seen["qwen2.5-0.5b"]
    # Replayed as each pool serves: its weights, method, draft length and tree.
    assert (small.model, small.weights, small.method, small.k) == (None, "auto", "adaptive", 8)
    assert small.tree_width == 2 and small.min_confidence is None
    assert small.tree_max_batch == 4 and small.tree_min_confidence is None
    assert (qwen.model, qwen.weights, qwen.method) == (
        "/models/qwen2.5-0.5b-instruct.gguf",
        "int8",
        "draft",
    )
    # A model that does not set its draft length is replayed at the engine's.
    assert qwen.k == engine_defaults.NUM_SPECULATIVE_TOKENS
