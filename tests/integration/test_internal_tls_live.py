"""`splitserve up --tls` for real: a coordinator, a prefill and a decode process whose every
internal gRPC call (registration, Prefill/Decode, KV-transfer control, the launcher's health
probes) is mutual TLS under a CA made for the run. The greedy reply equals the plain
single-process engine's; a worker takes no plaintext call and no TLS call without the run's
certificate; the run's certificate and key are gone once the stack stops."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from services.launcher import start_local_stack
from services.launcher.internal_tls import DeploymentCA
from services.launcher.presets import loopback_config
from shared.config.schema import parse_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.auth import InternalAuth
from shared.rpc.tls import TlsMaterial
from tests.integration.test_local_stack import expected_greedy

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def stack():
    config = parse_config(loopback_config())
    with start_local_stack(config, startup_timeout_s=240, tls=True) as running:
        yield running
    tls = running.config.internal_auth.tls
    assert not any(Path(p).exists() for p in (tls.ca_file, tls.cert_file, tls.key_file))


def _stats(auth: InternalAuth | None, address: str) -> grpc.StatusCode:
    channel = grpc.insecure_channel(address) if auth is None else auth.sync_channel(address)
    with channel:
        try:
            pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_greedy_chat_over_internal_tls_equals_single_process(stack, real_model, real_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France? One sentence."}]
    expected, _ = expected_greedy(real_model, real_tokenizer, messages, 16)
    body = {"model": DEFAULT_MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": 16}
    resp = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=120).json()
    assert resp["choices"][0]["message"]["content"] == expected
    assert "->" in resp["metadata"]["replica"]  # prefill->decode: both hops went over TLS


def test_workers_take_only_the_runs_certificate(stack):
    run = stack.internal_auth
    assert run.tls is not None and run.token is not None
    stranger = DeploymentCA.create("someone else's CA").issue()
    foreign = InternalAuth(run.token, TlsMaterial(run.tls.ca, stranger.cert_pem, stranger.key_pem))
    workers = httpx.get(f"{stack.url}/ready", timeout=5).json()["workers"]
    assert len(workers) == 2
    codes = {
        (info["role"], who): _stats(auth, info["address"])
        for info in workers.values()
        for who, auth in (("plaintext", None), ("foreign_cert", foreign), ("run", run))
    }
    refused = grpc.StatusCode.UNAVAILABLE  # in the handshake, before any method runs
    assert codes == {
        (role, who): grpc.StatusCode.OK if who == "run" else refused
        for role in ("prefill", "decode")
        for who in ("plaintext", "foreign_cert", "run")
    }
