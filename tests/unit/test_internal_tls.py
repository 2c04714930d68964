"""Internal mutual TLS, on real gRPC over loopback with certificates made here: a worker
service refuses a TLS client without a certificate, one whose certificate comes from another
CA, and a plaintext one; takes the deployment's certificate (and still checks the token
inside the TLS connection); a bad certificate file is a clear error at start; the plaintext
health port for the kubelet serves health alone."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.internal_tls import DeploymentCA, IssuedCertificate, with_internal_tls
from services.launcher.ports import pick_free_ports
from services.worker.health import WorkerHealth
from shared.config.schema import ConfigError, parse_config
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.auth import InternalAuth
from shared.rpc.tls import TlsMaterial

TOKEN = "t" * 32


@pytest.fixture(scope="module")
def ca() -> DeploymentCA:
    return DeploymentCA.create()


@pytest.fixture(scope="module")
def leaf(ca: DeploymentCA) -> IssuedCertificate:
    return ca.issue()


def _material(ca: DeploymentCA, leaf: IssuedCertificate) -> TlsMaterial:
    return TlsMaterial(ca.cert_pem, leaf.cert_pem, leaf.key_pem)


class _Worker(pb_grpc.WorkerServicer):
    async def Stats(self, request, context):
        return pb.StatsResponse(json="{}")


async def _stats_code(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_only_a_client_with_the_deployments_certificate_gets_through(ca, leaf):
    stranger_ca = DeploymentCA.create("someone else's CA")
    server_auth = InternalAuth(TOKEN, _material(ca, leaf))

    async def scenario() -> dict[str, grpc.StatusCode]:
        server = server_auth.server()
        pb_grpc.add_WorkerServicer_to_server(_Worker(), server)
        address = f"127.0.0.1:{server_auth.add_port(server, '127.0.0.1:0')}"
        await server.start()
        # Trusts the server's CA but presents no certificate of its own.
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem)
        clients = {
            "plaintext": grpc.aio.insecure_channel(address),
            "no_client_cert": grpc.aio.secure_channel(address, anonymous),
            "other_ca_cert": InternalAuth(
                TOKEN, TlsMaterial(ca.cert_pem, *_pems(stranger_ca.issue()))
            ).channel(address),
            "cert_without_token": InternalAuth(None, _material(ca, leaf)).channel(address),
            "cert_and_token": server_auth.channel(address),
        }
        try:
            return {name: await _stats_code(channel) for name, channel in clients.items()}
        finally:
            for channel in clients.values():
                await channel.close()
            await server.stop(grace=0)

    codes = asyncio.run(scenario())
    # Refused in the handshake: no method runs, so no status but "unavailable" can come back.
    assert codes == {
        "plaintext": grpc.StatusCode.UNAVAILABLE,
        "no_client_cert": grpc.StatusCode.UNAVAILABLE,
        "other_ca_cert": grpc.StatusCode.UNAVAILABLE,
        "cert_without_token": grpc.StatusCode.UNAUTHENTICATED,
        "cert_and_token": grpc.StatusCode.OK,
    }


def test_a_client_checks_the_servers_certificate_too(ca, leaf):
    """A server with a certificate from another CA is not trusted, even with the token."""
    impostor = DeploymentCA.create("impostor CA")

    async def scenario() -> grpc.StatusCode:
        fake = InternalAuth(TOKEN, TlsMaterial(impostor.cert_pem, *_pems(impostor.issue())))
        server = fake.server()
        pb_grpc.add_WorkerServicer_to_server(_Worker(), server)
        address = f"127.0.0.1:{fake.add_port(server, '127.0.0.1:0')}"
        await server.start()
        try:
            async with InternalAuth(TOKEN, _material(ca, leaf)).channel(address) as channel:
                return await _stats_code(channel)
        finally:
            await server.stop(grace=0)

    assert asyncio.run(scenario()) is grpc.StatusCode.UNAVAILABLE


def test_a_blocking_channel_speaks_tls(ca, leaf):
    auth = InternalAuth(None, _material(ca, leaf))

    async def scenario() -> str:
        server = auth.server()
        pb_grpc.add_WorkerServicer_to_server(_Worker(), server)
        address = f"127.0.0.1:{auth.add_port(server, '127.0.0.1:0')}"
        await server.start()
        try:
            return await asyncio.to_thread(_sync_stats, auth, address)
        finally:
            await server.stop(grace=0)

    assert asyncio.run(scenario()) == "{}"


def _sync_stats(auth: InternalAuth, address: str) -> str:
    with auth.sync_channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5).json


def _pems(issued: IssuedCertificate) -> tuple[bytes, bytes]:
    return issued.cert_pem, issued.key_pem


def _write(folder: Path, **files: bytes) -> dict[str, str]:
    paths = {}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        paths[name] = str(folder / name)
    return paths


def _tls_config(**files: str):
    return parse_config({"internal_auth": {"tls": {"enabled": True, **files}}})


def test_bad_certificate_files_are_clear_errors_at_start(tmp_path, ca, leaf):
    other = ca.issue()
    stranger = DeploymentCA.create("someone else's CA").issue()
    p = _write(
        tmp_path,
        ca=ca.cert_pem,
        cert=leaf.cert_pem,
        key=leaf.key_pem,
        other_key=other.key_pem,
        stranger_cert=stranger.cert_pem,
        stranger_key=stranger.key_pem,
        junk=b"not a certificate\n",
    )
    good = {"ca_file": p["ca"], "cert_file": p["cert"], "key_file": p["key"]}
    auth = InternalAuth.from_config(_tls_config(**good))
    assert auth.tls == TlsMaterial(ca.cert_pem, leaf.cert_pem, leaf.key_pem)

    cases = {
        "missing": (
            {**good, "ca_file": str(tmp_path / "nope.crt")},
            "internal_auth.tls.ca_file: .*nope.crt does not exist; `splitserve up --tls`",
        ),
        "not_pem": (
            {**good, "cert_file": p["junk"]},
            "cert_file: .*junk holds no PEM certificate",
        ),
        "key_not_a_key": ({**good, "key_file": p["junk"]}, "is not an unencrypted PEM private key"),
        "key_mismatch": (
            {**good, "key_file": p["other_key"]},
            "key_file .*other_key is not the key of cert_file .*cert; use the key",
        ),
        "other_ca": (
            {**good, "cert_file": p["stranger_cert"], "key_file": p["stranger_key"]},
            "cert_file .*stranger_cert was not issued by the CA in ca_file",
        ),
    }
    for files, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            InternalAuth.from_config(_tls_config(**files))

    with pytest.raises(ConfigError, match="TLS is enabled without cert_file, key_file"):
        _tls_config(ca_file=p["ca"])


def test_an_unreadable_key_file_is_a_clear_error(tmp_path, ca, leaf):
    p = _write(tmp_path, ca=ca.cert_pem, cert=leaf.cert_pem)
    (tmp_path / "key").mkdir()  # unreadable as a file even to root, unlike a mode of 0
    files = {"ca_file": p["ca"], "cert_file": p["cert"], "key_file": str(tmp_path / "key")}
    with pytest.raises(ConfigError, match="key_file: .*key: cannot read it"):
        InternalAuth.from_config(_tls_config(**files))


def test_splitserve_up_makes_a_private_ca_and_certificate_per_run(tmp_path):
    config = with_internal_tls(parse_config({}), tmp_path)
    tls = config.internal_auth.tls
    assert tls.enabled and tls.server_name == "localhost"
    for path in (tls.ca_file, tls.cert_file, tls.key_file):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert InternalAuth.from_config(config).tls is not None  # the files pass every check
    assert with_internal_tls(config, tmp_path / "elsewhere") == config  # its own certs are kept


def test_a_worker_with_a_missing_certificate_stops_at_start_naming_it(tmp_path, ca, leaf):
    """What a pod's log shows: the file and how to get one, before any model is loaded."""
    p = _write(tmp_path, ca=ca.cert_pem, key=leaf.key_pem)
    tls = {"enabled": True, "ca_file": p["ca"], "cert_file": str(tmp_path / "tls.crt")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"internal_auth": {"tls": {**tls, "key_file": p["key"]}}}))
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", "serve", "prefill", "--config", str(path)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"internal_auth.tls.cert_file: {tmp_path}/tls.crt does not exist" in done.stderr


def test_the_plaintext_health_port_serves_health_alone():
    """For the kubelet's probe: it answers SERVING in plaintext and serves nothing else."""

    async def scenario() -> tuple[str, grpc.StatusCode]:
        health = WorkerHealth()
        (port,) = pick_free_ports(1, "127.0.0.1")
        probes = await health.serve_plaintext("127.0.0.1", port)
        try:
            await health.serving()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                status = (await check(health_pb2.HealthCheckRequest(), timeout=5)).status
                return health_pb2.HealthCheckResponse.ServingStatus.Name(status), (
                    await _stats_code(channel)
                )
        finally:
            await probes.stop(grace=0)

    assert asyncio.run(scenario()) == ("SERVING", grpc.StatusCode.UNIMPLEMENTED)
