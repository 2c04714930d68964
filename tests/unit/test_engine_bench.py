"""`bench engine`'s decode rate counts only steps in which every sequence of the batch decodes."""

from __future__ import annotations

import pytest

from tools.bench import engine_bench


def test_every_sequence_decodes_through_the_measured_steps(tiny_model, monkeypatch):
    seen: list[int] = []
    real_step = engine_bench.Engine.step

    def step(self):
        out = real_step(self)
        seen.append(sum(1 for s in self.sequences.values() if s.output_token_ids))
        return out

    monkeypatch.setattr(engine_bench.Engine, "step", step)
    monkeypatch.setattr(engine_bench, "CONTEXT", 600)  # > one step's 512-token budget
    rate = engine_bench.decode_rate(tiny_model, batch=6, steps=5)
    assert rate > 0
    assert seen[-5:] == [6] * 5  # all six were decoding in each measured step


def test_a_run_where_sequences_finish_early_is_refused(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_bench, "SamplingParams", _short_params)
    with pytest.raises(RuntimeError, match="sequences decoded to the end"):
        engine_bench.decode_rate(tiny_model, batch=4, steps=8)


def _short_params(**kwargs):
    from shared.sampling.params import SamplingParams

    return SamplingParams(**(kwargs | {"max_tokens": 3}))


def test_the_default_lengths_are_kept_where_the_window_holds_them():
    shape = engine_bench.BenchShape.for_window(8192, block_size=16)
    assert shape == engine_bench.BenchShape(512, 1024, 2048, 1920)


@pytest.mark.parametrize("window", [128, 200, 1024, 2048])
def test_a_smaller_window_fits_every_length_inside_it(window):
    shape = engine_bench.BenchShape.for_window(window, block_size=16)
    # Each prompt leaves room for its sampled token; a decode run for its steps.
    assert shape.prefill_tokens < window and shape.prefix_tokens < window
    assert shape.context <= window // 2
    assert 0 < shape.prefix_cached_tokens < shape.prefix_tokens
    assert shape.prefix_cached_tokens % 16 == 0


def test_a_window_too_small_to_measure_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from engine.model.tiny_families import save_family
    from tools.cli import main

    save_family("llama3", tmp_path, max_position_embeddings=64)
    capsys.readouterr()  # transformers' progress bar while saving
    assert main(["bench", "engine", "--model", str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "splitserve: error: bench engine: it needs a context window of at least "
        "128 tokens; this model's is 64"
    ]


def test_a_tiny_family_folder_runs_at_lengths_its_window_holds(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from engine.model.tiny_families import save_family

    save_family("gemma3", tmp_path)  # window 1,024: the 2,048-token prefix would not fit
    monkeypatch.setattr(engine_bench, "measure_read_bandwidth_gb_s", lambda: 10.0)
    r = engine_bench.run("auto", str(tmp_path), threads=1, quick=True)
    assert r["model_context_window"] == 1024
    assert r["prefix_prompt_tokens"] < 1024 and r["prefill_prompt_tokens"] < 1024
    assert r["decode_tok_s_b1"] > 0 and r["prefill_tok_s_1k"] > 0
    assert 0 < r["prefix_ttft_ratio"]
