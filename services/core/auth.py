"""Who may talk to a service: one shared secret per deployment, checked on every port, never sent on any.

Every credential is derived from the secret with HKDF-SHA256 under its own label, so what one port sees gives
nothing on another:

    gRPC       every call carries ``authorization: Bearer <bearer>``, the bearer derived from the secret; servers
               compare it in constant time and refuse anything else with UNAUTHENTICATED before looking the method
               up. TLS (mTLS: clients must present a certificate signed by ``tls_ca``) through gRPC's own
               credentials; ``serve`` wants it on any non-loopback address (or an explicit --insecure-plaintext).
    ZeroMQ     CURVE on every data port, the server and client key pairs derived from the secret: holding it is
               what lets a peer complete the handshake (the ZAP handler admits only the derived client key). A peer
               without it gets nothing: its messages never reach a handler. CURVE encrypts.
    metrics    the Prometheus endpoint wants the scrape token (also derived): it reads metrics and calls nothing.
               Over TLS with the service's certificate when --metrics-tls is set.

Every process configures this once (``configure``): services from their flags and RLFABRIC_TOKEN /
RLFABRIC_TOKEN_FILE, clients and the CLI from the environment, a local stack with a secret it generates. Without a
token everything runs in the clear, which ``serve`` allows on loopback only.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import stat
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc
import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)
TOKEN_ENV, TOKEN_FILE_ENV = "RLFABRIC_TOKEN", "RLFABRIC_TOKEN_FILE"
PLAINTEXT_ENV = "RLFABRIC_INSECURE_PLAINTEXT"  # --insecure-plaintext's variable; for clients too
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
        """A server identity: a service serves TLS with it."""
        return bool(self.cert and self.key)

    @property
    def client_enabled(self) -> bool:
        """A client speaks TLS with a CA to verify servers by (and presents cert/key when it has them too)."""
        return bool(self.ca) or self.enabled

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


def derive(secret: str, label: str) -> bytes:
    """32 bytes for one use of the deployment's secret: HKDF-SHA256 (RFC 5869), one block, ``label`` as info.
    Knowing one label's output (the bearer a sniffer saw) gives neither the secret nor another label's."""
    prk = hmac.new(b"rlfabric/hkdf/v1", secret.encode(), hashlib.sha256).digest()
    return hmac.new(prk, label.encode() + b"\x01", hashlib.sha256).digest()


class PlaintextRefused(AuthError):
    """A channel that would carry the deployment's bearer in clear to another host."""


@dataclass(frozen=True)
class Security:
    token: str = ""
    tls: TLSFiles = TLSFiles()
    plaintext_ok: bool = False  # the operator's --insecure-plaintext (or RLFABRIC_INSECURE_PLAINTEXT=1)

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    @cached_property
    def bearer(self) -> str:
        """What gRPC calls carry (never the secret itself)."""
        return base64.urlsafe_b64encode(derive(self.token, "rlfabric/grpc-bearer")).rstrip(b"=").decode()

    @cached_property
    def scrape_token(self) -> str:
        """What a metrics scraper presents: it reads /metrics and is refused by every gRPC method."""
        return base64.urlsafe_b64encode(derive(self.token, "rlfabric/metrics-scrape")).rstrip(b"=").decode()

    @cached_property
    def _authorization(self) -> bytes:
        return f"Bearer {self.bearer}".encode()

    @cached_property
    def _scrape_authorization(self) -> bytes:
        return f"Bearer {self.scrape_token}".encode()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self._authorization.decode()),) if self.token else ()

    def accepts(self, value: str | bytes | None) -> bool:
        """Constant-time check of a gRPC call's ``authorization`` header value."""
        return _matches(self.token, self._authorization if self.token else b"", value)

    def accepts_scrape(self, value: str | bytes | None) -> bool:
        """Constant-time check of a metrics request's ``Authorization`` header value."""
        return _matches(self.token, self._scrape_authorization if self.token else b"", value)

    # -- CURVE keys derived from the secret ---------------------------------------------------------------------
    def _secret_key(self, role: str) -> bytes:
        return z85.encode(derive(self.token, f"rlfabric/curve/{role}"))

    def curve_keys(self, role: str) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of ``role`` ("server" or "client")."""
        secret = self._secret_key(role)
        return zmq.curve_public(secret), secret


def _matches(token: str, expected: bytes, value: str | bytes | None) -> bool:
    if not token:
        return True
    if isinstance(value, str):
        value = value.encode(errors="replace")
    return hmac.compare_digest(value or b"", expected)


_current = Security()
_lock = threading.Lock()
_authenticator = None


def configure(token: str = "", tls: TLSFiles | None = None, plaintext_ok: bool | None = None) -> Security:
    """Set this process's security (every channel, data socket and server made afterwards uses it).
    ``plaintext_ok`` (default: RLFABRIC_INSECURE_PLAINTEXT=1) lets its channels carry the bearer in clear to a host
    other than this one; without it such a channel is refused (``check_plaintext``)."""
    global _current
    if token and len(token) < MIN_TOKEN_CHARS:
        raise AuthError(f"the token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
                        f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    if plaintext_ok is None:
        plaintext_ok = plaintext_from_environment()
    _current = Security(token, tls or TLSFiles(), plaintext_ok)
    return _current


def plaintext_from_environment() -> bool:
    """RLFABRIC_INSECURE_PLAINTEXT=1: the operator lets this process's clients talk to other hosts without TLS."""
    return os.environ.get(PLAINTEXT_ENV, "").strip().lower() in ("1", "true", "yes", "on")  # as the flag's env


def current() -> Security:
    return _current


OPERATOR_METADATA_KEY = "rlfabric-operator"
OPERATOR_TOKEN_FILE_ENV = "RLFABRIC_OPERATOR_TOKEN_FILE"


def operator_credential(operator_secret: str) -> str:
    """What a call that acts as the operator carries (``rlfabric-operator`` metadata, beside the deployment's
    bearer): derived from the operator's own secret, which run services never hold, so a token holder cannot
    present it. Clearing a robot's e-stop or latched fault takes it."""
    return base64.urlsafe_b64encode(derive(operator_secret, "rlfabric/robot-operator")).rstrip(b"=").decode()


def operator_accepts(operator_secret: str, value: str | bytes | None) -> bool:
    """Constant-time check of a call's operator credential; with no operator secret, nothing is accepted."""
    if not operator_secret:
        return False
    if isinstance(value, str):
        value = value.encode(errors="replace")
    return hmac.compare_digest(value or b"", operator_credential(operator_secret).encode())


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
    return write_private_file(path, (token + "\n").encode())


def write_private_file(path: str | Path, data: bytes) -> Path:
    """``data`` in a regular file only its owner can read or write. Created (parents 0700) or replaced in place:
    a symlink at ``path`` is refused rather than followed (it could point the secret anywhere), and an existing
    file is chmodded 0600 through its descriptor before anything is written to it, whatever mode it had."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AuthError(f"refusing to write a secret through the symlink {str(path)!r}. Fix: remove it, or "
                            f"name the real file") from None
        raise AuthError(f"cannot write {str(path)!r} ({exc.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AuthError(f"refusing to write a secret to {str(path)!r}: it is not a regular file")
        if info.st_uid != os.geteuid():
            raise AuthError(f"refusing to write a secret to {str(path)!r}: another user (uid {info.st_uid}) owns "
                            f"it. Fix: remove it, or choose another path")
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        f.write(data)
    return path


def token_from_environment(token_file: str = "") -> str:
    """The deployment's secret from ``token_file``, RLFABRIC_TOKEN_FILE or RLFABRIC_TOKEN (in that order); ''
    when none is set."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV, "")
    return read_token_file(path) if path else os.environ.get(TOKEN_ENV, "").strip()


def from_environment(token_file: str = "", tls: TLSFiles | None = None, plaintext_ok: bool | None = None) -> Security:
    """The token as ``token_from_environment`` finds it, TLS files from the arguments or RLFABRIC_TLS_*; configured
    for this process."""
    return configure(token_from_environment(token_file), tls or tls_from_environment(), plaintext_ok)


def tls_from_environment() -> TLSFiles:
    """RLFABRIC_TLS_CERT / _KEY / _CA (empty where unset)."""
    return TLSFiles(*(os.environ.get(TLS_ENV[k], "") for k in ("cert", "key", "ca")))


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
async def _refuse(request_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong token: this service wants the bearer derived from the deployment's secret "
                        "(give the client RLFABRIC_TOKEN or RLFABRIC_TOKEN_FILE)")
    yield  # pragma: no cover (never reached: abort raises)


# Raw bytes in and out, any call kind (on the wire every gRPC call is a stream): a refused call never has its
# method looked up, its request read or anything counted.
_REFUSE = grpc.stream_stream_rpc_method_handler(_refuse)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the deployment's bearer (health checks included: a prober holds the
    secret too). The first interceptor: nothing runs for a call it refuses, unknown methods included."""

    def __init__(self, security: Security):
        self.security = security

    async def intercept_service(self, continuation, details):
        value = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), None)
        if self.security.accepts(value):
            return await continuation(details)
        return _REFUSE


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
    mutual = ca is not None and cert is not None and key is not None  # a client certificate for mTLS servers
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key if mutual else None,
                                        certificate_chain=cert if mutual else None)


def host_of(address: str) -> str:
    """The host of a gRPC target: ``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:host:port``."""
    target = address.split("///", 1)[-1]
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        target = target.removeprefix(scheme)
    if target.startswith("unix:"):
        return "localhost"  # a socket file: this host
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host.strip("[]")


def check_plaintext(address: str, security: Security) -> None:
    """Refuse a channel that would carry the bearer in clear off this host: with a token and no TLS, only loopback
    peers, unless the operator said otherwise (--insecure-plaintext, RLFABRIC_INSECURE_PLAINTEXT=1)."""
    if security.token and not security.tls.client_enabled and not security.plaintext_ok \
            and not is_loopback(host_of(address)):
        raise PlaintextRefused(
            f"refusing to send the deployment's bearer to {address} in the clear: anyone on the network could read "
            f"it and then drive every service. Fix: give this client the deployment's CA ({TLS_ENV['ca']}, or "
            f"--tls-ca on a service; `rlfabric certs` makes it) so it speaks TLS, or, on a network you trust, set "
            f"{PLAINTEXT_ENV}=1 (a service: --insecure-plaintext)")


def aio_channel(address: str, options: list, security: Security | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel that presents this process's token (and TLS, when configured)."""
    security = security or _current
    check_plaintext(address, security)
    interceptors = [cls(security.metadata()) for cls in (_AioTokenUU, _AioTokenUS, _AioTokenSU, _AioTokenSS)] \
        if security.token else None
    if security.tls.client_enabled:
        return grpc.aio.secure_channel(address, _channel_credentials(security), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, options: list, security: Security | None = None) -> grpc.Channel:
    """A blocking channel (clients, the CLI, health probes) that presents this process's token."""
    security = security or _current
    check_plaintext(address, security)
    if security.tls.client_enabled:
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
class MetricsServer:
    """Prometheus' text format behind the scrape token, over TLS when given a context: one asyncio loop in one
    thread, whatever the number of connections. A connection gets ``timeout_s`` to send its request head (at most
    ``MAX_HEAD_BYTES``) and to take the reply; past ``max_connections`` open ones, the oldest is dropped, so idle
    connections (slowloris) neither pile up threads nor keep a scrape out."""

    MAX_HEAD_BYTES = 16 * 1024

    def __init__(self, addr: str, port: int, security: Security, ssl_context: ssl.SSLContext | None = None,
                 timeout_s: float = 5.0, max_connections: int = 64):
        from prometheus_client import REGISTRY

        self.security, self.ssl_context = security, ssl_context
        self.timeout_s, self.max_connections = timeout_s, max_connections
        self.registry = REGISTRY
        self._sock = socket.create_server((addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET,
                                          backlog=128)
        self.port = self._sock.getsockname()[1]
        self._open: collections.OrderedDict[asyncio.StreamWriter, None] = collections.OrderedDict()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(
            self._serve, sock=self._sock, ssl=self.ssl_context, limit=self.MAX_HEAD_BYTES,
            ssl_handshake_timeout=self.timeout_s if self.ssl_context else None))
        self._started.set()
        self._loop.run_forever()

    @property
    def connections(self) -> int:
        return len(self._open)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = None
        while len(self._open) > self.max_connections:
            oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.transport.abort()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.timeout_s)
            status, headers, body = self._respond(head)
            writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n".encode()
                         + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers) + b"\r\n" + body)
            writer.close()  # once the reply is flushed (a reader that does not take it is cut off below)
            await asyncio.wait_for(writer.wait_closed(), self.timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError):
            pass  # slow, oversized, half-sent or gone: the connection is cut below, nothing else to do
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    def _respond(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        from prometheus_client.exposition import choose_encoder

        request, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if request.split(" ", 1)[0] != "GET":
            return "405 Method Not Allowed", [("Allow", "GET"), ("Content-Type", "text/plain")], b"GET only\n"
        if not self.security.accepts_scrape(headers.get("authorization")):
            return ("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")],
                    b"metrics want 'Authorization: Bearer <scrape token>' (`rlfabric scrape-token` prints it)\n")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        return "200 OK", [("Content-Type", content_type)], encoder(self.registry)

    async def _close(self) -> None:
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def shutdown(self) -> None:
        """Stop listening, cut every connection, end the thread."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def server_ssl_context(security: Security) -> ssl.SSLContext:
    """A TLS server context from this process's certificate and key (what --metrics-tls serves with)."""
    if not security.tls.enabled:
        raise AuthError("metrics over TLS want this service's certificate. Fix: give --tls-cert and --tls-key "
                        "(`rlfabric certs` makes them), or drop --metrics-tls")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(security.tls.cert, security.tls.key)
    return context


def start_metrics_server(port: int, addr: str, security: Security | None = None, tls: bool = False
                         ) -> tuple[MetricsServer, int]:
    """The metrics endpoint (see MetricsServer); ``tls`` serves it with this process's certificate. Returns
    (server, bound port)."""
    security = security or _current
    server = MetricsServer(addr, port, security, server_ssl_context(security) if tls else None)
    return server, server.port


def metrics_headers(security: Security | None = None) -> dict[str, str]:
    """Headers a metrics scraper sends (tests and tools): the scrape token, never the gRPC bearer."""
    security = security or _current
    return {"Authorization": f"Bearer {security.scrape_token}"} if security.token else {}


__all__ = ["OPERATOR_METADATA_KEY", "OPERATOR_TOKEN_FILE_ENV", "PLAINTEXT_ENV", "AuthError", "MetricsServer",
           "PlaintextRefused", "Security", "TLSFiles", "TokenInterceptor", "add_port", "aio_channel",
           "check_plaintext", "configure", "current", "derive", "from_environment", "generate_token", "host_of",
           "is_loopback", "metrics_headers", "operator_accepts", "operator_credential", "plaintext_from_environment",
           "read_token_file", "secure_client_socket", "secure_server_socket", "server_ssl_context",
           "start_metrics_server", "sync_channel", "token_from_environment", "write_private_file", "write_token_file"]
