"""Services that trust only each other: a deployment-wide token on every internal gRPC call.

Anyone who can reach a worker's port could otherwise run prompts on it (bypassing API keys
and tiers) or abort other users' requests. Every internal client (registry, Prefill/Decode
worker RPCs, kvtransfer control, the fleet view) sends `authorization: Bearer <token>`, and
every internal server refuses a call without the right one with UNAUTHENTICATED, and logs it.
The token is compared in constant time (hmac.compare_digest): how long a refusal takes says
nothing about how much of a guess was right. grpc.health.v1 stays open: the kubelet's gRPC
probe sends no metadata, and a health answer reveals nothing.

The tcp/shm data plane never carries the token itself: its handshake carries an HMAC of the
request header keyed by it (services/kvtransfer/wire.py). The token is read from
`internal_auth.token_file` once, at start (`splitserve up` writes one per run; the chart
mounts a Secret).

With `internal_auth.tls` on, every internal gRPC server and channel is mutual TLS besides
(shared/rpc/tls.py): the token checks still run, inside the TLS connection. Off, channels and
ports are plaintext exactly as before.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from shared.config.schema import ConfigError, DeploymentConfig

if TYPE_CHECKING:
    from shared.rpc.tls import TlsMaterial

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
# Methods anyone may call: probes (the kubelet's gRPC probe carries no metadata).
OPEN_METHODS = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 16


def read_token(path: str) -> str:
    """The token in `path` (surrounding whitespace dropped), or a ConfigError saying why not."""
    where = f"internal_auth.token_file: {path}"
    try:
        token = Path(path).read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist (splitserve up writes one per run; the chart mounts the "
            "internal-token Secret there; or write one: `openssl rand -hex 32 > FILE`)"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc}") from exc
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where} holds {len(token)} characters; at least {MIN_TOKEN_CHARS}")
    return token


@dataclass(frozen=True)
class InternalAuth:
    """How this process talks to, and is talked to by, the deployment's other services."""

    token: str | None = None  # None: internal calls are not authenticated
    tls: TlsMaterial | None = None  # None: plaintext gRPC

    @classmethod
    def from_config(cls, config: DeploymentConfig) -> InternalAuth:
        settings = config.internal_auth
        path = settings.token_file
        tls = None
        if settings.tls.enabled:
            # Only then: cryptography costs a deployment without TLS ~30 ms of every start.
            from shared.rpc.tls import TlsMaterial

            tls = TlsMaterial.from_config(settings.tls)
        return cls(read_token(path) if path else None, tls)

    @property
    def has_token(self) -> bool:
        return self.token is not None

    @property
    def transfer_key(self) -> bytes | None:
        """The data plane's HMAC key: derived, so the token itself is never used twice."""
        if self.token is None:
            return None
        return hashlib.sha256(b"splitserve-kvtransfer\0" + self.token.encode()).digest()

    def _metadata(self) -> tuple[str, str]:
        return (AUTH_METADATA_KEY, f"Bearer {self.token}")

    def accepts(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        if self.token is None:
            return True
        expected = f"Bearer {self.token}".encode()
        for key, value in metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, expected)
        return False

    # -- servers -------------------------------------------------------------------------

    def server(self, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Server:
        interceptors = [TokenCheck(self)] if self.has_token else []
        return grpc.aio.server(options=list(options), interceptors=interceptors)

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address` (TLS when on); the port bound."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())

    # -- clients -------------------------------------------------------------------------

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        interceptors = token_interceptors(self._metadata()) if self.has_token else None
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(
            address,
            self.tls.channel_credentials(),
            options=self.tls.channel_options(options),
            interceptors=interceptors,
        )

    def sync_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel (benchmarks, tests, the launcher's health probe)."""
        if self.tls is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            credentials = self.tls.channel_credentials()
            channel = grpc.secure_channel(address, credentials, self.tls.channel_options(options))
        if not self.has_token:
            return channel
        return grpc.intercept_channel(channel, SyncAddToken(self._metadata()))


# Immutable: the default of every client and server that is not told of a token.
NO_AUTH = InternalAuth()


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the deployment's token (but the open methods)."""

    def __init__(self, auth: InternalAuth):
        self._auth = auth

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        if self._auth.accepts(details.invocation_metadata):
            return handler
        log.warning("refused an unauthenticated call to %s", details.method)
        return _refusing(handler, details.method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers UNAUTHENTICATED."""
    message = f"{method}: missing or wrong internal token (internal_auth.token_file)"

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _with_metadata(details: Any, pair: tuple[str, str], make: Any) -> Any:
    metadata = [*(details.metadata or ()), pair]
    return make(
        method=details.method,
        timeout=details.timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


class _AddToken:
    """Puts the token on every call of an aio channel; one subclass per kind of call, since
    an aio channel files each interceptor under the first kind it implements only."""

    def __init__(self, pair: tuple[str, str]):
        self._pair = pair

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return _with_metadata(details, self._pair, grpc.aio.ClientCallDetails)


class _UnaryUnaryToken(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryToken(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamToken(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(pair: tuple[str, str]) -> list[_AddToken]:
    kinds = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)
    return [kind(pair) for kind in kinds]


@dataclass(frozen=True)
class _SyncDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any = None


class SyncAddToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Puts the token on every call of a blocking channel."""

    def __init__(self, pair: tuple[str, str]):
        self._pair = pair

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _with_metadata(details, self._pair, _SyncDetails)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
