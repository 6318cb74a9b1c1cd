"""Who may talk to a service: one shared secret per deployment, checked on every port.

    gRPC       every call carries ``authorization: Bearer <token>`` in its metadata; servers compare it in constant
               time and refuse anything else with UNAUTHENTICATED. Optional TLS (and mTLS: clients must present a
               certificate signed by ``tls_ca``) through gRPC's own credentials.
    ZeroMQ     CURVE on every data port. The server and client key pairs are derived from the token (HKDF-SHA256),
               so holding the token is what lets a peer complete the handshake; the ZAP handler admits only the
               derived client key. A peer without it gets nothing: its messages never reach a handler.
    metrics    the Prometheus endpoint wants the same bearer token (Prometheus' ``authorization`` scrape setting).

Every process configures this once (``configure``): services from their flags and RLFABRIC_TOKEN /
RLFABRIC_TOKEN_FILE, clients and the CLI from the environment, a local stack with a secret it generates. Without a
token everything runs in the clear, which ``serve`` allows on loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)
TOKEN_ENV, TOKEN_FILE_ENV = "RLFABRIC_TOKEN", "RLFABRIC_TOKEN_FILE"
TLS_ENV = {"cert": "RLFABRIC_TLS_CERT", "key": "RLFABRIC_TLS_KEY", "ca": "RLFABRIC_TLS_CA"}
METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16


class AuthError(ValueError):
    """A secret or certificate setting that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: this process's certificate and key (server and client identity), and the CA that signs every
    process's certificate (with it, servers require client certificates: mTLS)."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert and self.key)

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def load(path: str, what: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise AuthError(f"cannot read the TLS {what} {path!r} ({exc.strerror}). Fix: point --tls-{what} "
                                f"(or {TLS_ENV[what]}) at a readable PEM file") from None

        return load(self.cert, "cert"), load(self.key, "key"), load(self.ca, "ca")


@dataclass(frozen=True)
class Security:
    token: str = ""
    tls: TLSFiles = TLSFiles()

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def accepts(self, value: str | bytes | None) -> bool:
        """Constant-time check of an ``authorization`` header value."""
        if not self.token:
            return True
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        return hmac.compare_digest((value or "").encode(), f"Bearer {self.token}".encode())

    # -- CURVE keys derived from the token --------------------------------------------------------------------
    def _secret_key(self, role: str) -> bytes:
        material = hmac.new(self.token.encode(), f"rlfabric/curve/{role}".encode(), hashlib.sha256).digest()
        return z85.encode(material)

    def curve_keys(self, role: str) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of ``role`` ("server" or "client")."""
        secret = self._secret_key(role)
        return zmq.curve_public(secret), secret


_current = Security()
_lock = threading.Lock()
_authenticator = None


def configure(token: str = "", tls: TLSFiles | None = None) -> Security:
    """Set this process's security (every channel, data socket and server made afterwards uses it)."""
    global _current
    if token and len(token) < MIN_TOKEN_CHARS:
        raise AuthError(f"the token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
                        f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    _current = Security(token, tls or TLSFiles())
    return _current


def current() -> Security:
    return _current


def generate_token() -> str:
    return secrets.token_urlsafe(32)


def read_token_file(path: str) -> str:
    p = Path(path)
    try:
        text = p.read_text().strip()
        mode = p.stat().st_mode
    except OSError as exc:
        raise AuthError(f"cannot read the token file {path!r} ({exc.strerror}). Fix: point --token-file (or "
                        f"{TOKEN_FILE_ENV}) at the file holding the deployment's secret") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by other users; chmod 600 it", path)
    if not text:
        raise AuthError(f"the token file {path!r} is empty")
    return text


def write_token_file(path: str | Path, token: str) -> Path:
    """The token in a file only its owner can read (what a notebook points RLFABRIC_TOKEN_FILE at)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def from_environment(token_file: str = "", tls: TLSFiles | None = None) -> Security:
    """The token from ``token_file``, RLFABRIC_TOKEN_FILE or RLFABRIC_TOKEN (in that order), TLS files from the
    arguments or RLFABRIC_TLS_*; configured for this process."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV, "")
    token = read_token_file(path) if path else os.environ.get(TOKEN_ENV, "").strip()
    tls = tls or TLSFiles(*(os.environ.get(TLS_ENV[k], "") for k in ("cert", "key", "ca")))
    return configure(token, tls)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


# -- gRPC ---------------------------------------------------------------------------------------------------------
def _deny(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call."""
    async def abort(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover (never reached: abort raises)

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the deployment's token (health checks included: a prober holds the
    token too)."""

    def __init__(self, security: Security):
        self.security = security

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self.security.accepts(dict(details.invocation_metadata or ()).get(METADATA_KEY)):
            return handler
        return _deny(handler, "missing or wrong token: this service wants the deployment's secret "
                              "(RLFABRIC_TOKEN or RLFABRIC_TOKEN_FILE) as 'authorization: Bearer <token>'")


class _Metadata:
    """grpc.aio files each client interceptor under one call kind only (the first it is an instance of), so each kind
    gets its own small class adding the token."""

    def __init__(self, metadata: tuple):
        self.metadata = metadata


class _AioTokenUU(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self.metadata), request)


class _AioTokenUS(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self.metadata), request)


class _AioTokenSU(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self.metadata), request_iterator)


class _AioTokenSS(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_aio_details(details, self.metadata), request_iterator)


def _aio_details(details: grpc.aio.ClientCallDetails, metadata: tuple) -> grpc.aio.ClientCallDetails:
    merged = grpc.aio.Metadata(*(tuple(details.metadata or ()) + metadata))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, merged, details.credentials,
                                      details.wait_for_ready)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple):
        self.metadata = metadata

    def _details(self, details):
        return _SyncDetails(details.method, details.timeout, tuple(details.metadata or ()) + self.metadata,
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def _channel_credentials(security: Security) -> grpc.ChannelCredentials:
    cert, key, ca = security.tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key if ca else None,
                                        certificate_chain=cert if ca else None)


def aio_channel(address: str, options: list, security: Security | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel that presents this process's token (and TLS, when configured)."""
    security = security or _current
    interceptors = [cls(security.metadata()) for cls in (_AioTokenUU, _AioTokenUS, _AioTokenSU, _AioTokenSS)] \
        if security.token else None
    if security.tls.enabled:
        return grpc.aio.secure_channel(address, _channel_credentials(security), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, options: list, security: Security | None = None) -> grpc.Channel:
    """A blocking channel (clients, the CLI, health probes) that presents this process's token."""
    security = security or _current
    if security.tls.enabled:
        channel = grpc.secure_channel(address, _channel_credentials(security), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _SyncToken(security.metadata())) if security.token else channel


def add_port(server: grpc.aio.Server, address: str, security: Security | None = None) -> int:
    """Bind the server: TLS (mTLS when a CA is configured) or in the clear."""
    security = security or _current
    if not security.tls.enabled:
        return server.add_insecure_port(address)
    cert, key, ca = security.tls.read()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
    return server.add_secure_port(address, creds)


# -- ZeroMQ CURVE ---------------------------------------------------------------------------------------------------
def secure_server_socket(sock: zmq.Socket, security: Security | None = None) -> None:
    """Make a bound socket a CURVE server that admits only the derived client key (before bind)."""
    security = security or _current
    if not security.token:
        return
    _start_authenticator(security)
    public, secret = security.curve_keys("server")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def secure_client_socket(sock: zmq.Socket, security: Security | None = None) -> None:
    """Make a connecting socket a CURVE client of a deployment server (before connect)."""
    security = security or _current
    if not security.token:
        return
    public, secret = security.curve_keys("client")
    sock.curve_serverkey = security.curve_keys("server")[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret


class _AdmitDerivedClient:
    """pyzmq's CURVE credentials provider: admits the one client key (z85, as the ZAP handler passes it)."""

    def __init__(self, key: bytes):
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def _start_authenticator(security: Security) -> None:
    """One ZAP handler per process (the global ZeroMQ context), admitting the client key of the current token."""
    global _authenticator
    from zmq.auth.thread import ThreadAuthenticator

    with _lock:
        if _authenticator is None:
            _authenticator = ThreadAuthenticator(zmq.Context.instance(), log=logging.getLogger("rlfabric.zap"))
            _authenticator.start()
        _authenticator.configure_curve_callback("*", credentials_provider=_AdmitDerivedClient(
            security.curve_keys("client")[0]))


# -- the metrics endpoint ----------------------------------------------------------------------------------------
def start_metrics_server(port: int, addr: str, security: Security | None = None) -> tuple[object, int]:
    """Prometheus' WSGI app behind the bearer token (when one is configured). Returns (server, bound port)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    security = security or _current
    app = make_wsgi_app()

    def guarded(environ, start_response):
        if not security.accepts(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
            return [b"metrics want 'Authorization: Bearer <token>' (the deployment's RLFABRIC_TOKEN)\n"]
        return app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:
            pass

    httpd = make_server(addr, port, guarded, server_class=Server, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd, httpd.server_port


def metrics_headers(security: Security | None = None) -> dict[str, str]:
    """Headers a metrics scraper sends (tests and tools)."""
    security = security or _current
    return {"Authorization": f"Bearer {security.token}"} if security.token else {}


__all__ = ["AuthError", "Security", "TLSFiles", "TokenInterceptor", "add_port", "aio_channel", "configure",
           "current", "from_environment", "generate_token", "is_loopback", "read_token_file", "secure_client_socket",
           "secure_server_socket", "start_metrics_server", "sync_channel", "write_token_file", "metrics_headers"]
