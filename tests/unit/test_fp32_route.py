"""The fp32 GEMM route: every call it may choose computes x @ W.T, the choice is measured per
weight shape and row count, and what is not measured (or not small) goes through `linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.model import fp32_route
from shared.model.linear import Linear


def test_every_call_computes_the_same_product():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    for rows in (1, 2, 3, 8, 16):
        x = torch.randn(rows, 64)
        want = F.linear(x, w)
        for name, call in fp32_route._calls(rows).items():
            got = call(x, w)
            assert got.shape == want.shape and got.is_contiguous(), name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routes_are_measured_once_per_row_count_over_registered_weights():
    torch.manual_seed(1)
    layer = Linear(torch.randn(80, 48), "fp32")  # registers its weight
    x = torch.randn(3, 48)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    key = (80, 48, 3, threads)
    assert key in fp32_route._routes
    assert fp32_route._routes[key] in fp32_route._calls(3)
    assert (3, threads) in fp32_route._measured
    assert f"80x48, 3 rows, {threads} threads" in fp32_route.measured_routes()
    # The single-row call that pairs the row is offered for one row only.
    assert "paired" in fp32_route._calls(1) and "paired" not in fp32_route._calls(3)


def test_the_faster_call_is_kept(monkeypatch):
    torch.manual_seed(2)
    layer = Linear(torch.randn(40, 24), "fp32")
    slow = {"linear": 3.0, "weight-stationary": 1.0, "paired": 2.0}

    def fake_pass(call, weights, xs):
        name = next(n for n, c in fp32_route._calls(1).items() if c is call)
        return {(w.shape[0], w.shape[1]): slow[name] for w in weights}

    monkeypatch.setattr(fp32_route, "_pass_seconds", fake_pass)
    monkeypatch.setattr(fp32_route, "_measured", set())
    monkeypatch.setattr(fp32_route, "_routes", {})
    x = torch.randn(1, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.fp32), rtol=1e-5, atol=1e-5)
    assert fp32_route._routes[(40, 24, 1, torch.get_num_threads())] == "weight-stationary"


def test_large_batches_and_unmeasured_shapes_take_linear(monkeypatch):
    monkeypatch.setattr(fp32_route, "_measure", lambda rows, threads: None)
    w = torch.randn(16, 8)  # never registered: no route for its shape
    x = torch.randn(2, 8)
    monkeypatch.setattr(fp32_route, "_measured", {(2, torch.get_num_threads())})
    torch.testing.assert_close(fp32_route.fp32_linear(x, w), F.linear(x, w))
    big = torch.randn(fp32_route.SMALL_ROWS + 1, 8)
    torch.testing.assert_close(fp32_route.fp32_linear(big, w), F.linear(big, w))


def test_a_new_shape_is_measured_again_with_the_rest():
    torch.manual_seed(3)
    first = Linear(torch.randn(72, 40), "fp32")
    x = torch.randn(2, 40)
    first(x)
    threads = torch.get_num_threads()
    assert (2, threads) in fp32_route._measured
    second = Linear(torch.randn(56, 40), "fp32")  # a shape nothing measured yet
    assert (2, threads) not in fp32_route._measured
    torch.testing.assert_close(second(x), F.linear(x, second.fp32), rtol=1e-5, atol=1e-5)
    assert (56, 40, 2, threads) in fp32_route._routes
    assert (72, 40, 2, threads) in fp32_route._routes
