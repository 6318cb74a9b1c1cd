"""ZeroMQ data plane: request/reply channels that move TensorBatches as ``[header, buffers...]`` frames.

``DataServer`` (ROUTER, bound) answers requests in the thread that runs ``serve``; a handler may answer later
(a parked long-poll) through the ``Reply`` it is given. ``DataClient`` (DEALER, connected) sends requests, can
pipeline several, and matches answers by sequence number. High-water marks bound every queue (back-pressure);
corrupt or oversized messages are answered with an error and logged, and the channel keeps working.
Sockets are used only by the thread that made them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from rlfabric.services.core import auth, progress
from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import FrameError, decode, encode, message_bytes

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """The peer received the request and refused it; the message is the peer's reason."""


class PeerTimeout(TimeoutError):
    """The peer did not answer in time: it is busy, dead or unreachable."""


FENCE_KEY = "fence"


class StaleAttempt(ValueError):
    """A request from a worker of an attempt of the run that has ended. The coordinator gives every attempt a new
    random fence; a worker it lost (unreachable, not dead) may still reach its peers, and its requests are refused
    so that its stale batches, env steps and gets cannot mix into the attempt that replaced it."""


def fence_of(context: object) -> str:
    """A Configure's context_json.fence ('' when it has none), checked: a ValueError naming the field."""
    fence = context.get(FENCE_KEY, "") if isinstance(context, dict) else ""
    if not isinstance(fence, str) or len(fence) > 64:
        raise ValueError("context_json.fence must be a string of at most 64 characters (the coordinator's)")
    return fence


def check_fence(meta: dict, fence: str, service: str) -> None:
    """Refuse a request stamped with another attempt's fence (unstamped ones, tools' and tests', pass)."""
    got = meta.get(FENCE_KEY)
    if fence and got is not None and got != fence:
        raise StaleAttempt(f"{service}: refused a request of an attempt of the run that has ended (fence "
                           f"{str(got)[:32]!r}, this {service} serves {fence!r}): the coordinator lost the sending "
                           f"worker and re-placed the run without it, so its work is stale; it registers anew")


def _socket(kind: int, hwm: int, max_bytes: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    # CURVE with keys derived from the deployment's token (none configured: in the clear, loopback only)
    (auth.secure_server_socket if kind == zmq.ROUTER else auth.secure_client_socket)(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    # Hard transport guard against memory exhaustion; messages between 1x and 2x the bound still arrive and are
    # refused with an explicit error by the application-level check (so the sender learns why).
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes)
    return sock


@dataclass
class Reply:
    """How a handler answers one request, now or later."""

    server: DataServer
    identity: bytes
    seq: int

    def send(self, kind: str, batch: TensorBatch | None = None) -> None:
        self.server._send(self.identity, encode(kind, batch, seq=self.seq))

    def error(self, reason: str) -> None:
        self.send("error", TensorBatch(meta={"reason": reason}))


Handler = Callable[[str, TensorBatch, Reply], None]


def meta_int(meta: dict, key: str, default: int, lo: int, hi: int) -> int:
    """An integer request field, bounded: a bad one is a ValueError (answered as a refusal) naming it."""
    value = meta.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"meta.{key} must be an integer in [{lo}, {hi}], got {str(value)[:40]!r}")
    return value


def meta_float(meta: dict, key: str, default: float, lo: float, hi: float) -> float:
    """A number request field, bounded and finite (the codec refuses NaN/inf already)."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ValueError(f"meta.{key} must be a number in [{lo}, {hi}], got {str(value)[:40]!r}")
    return float(value)


class DataServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_bytes: int, hwm: int = 64,
                 name: str = "data", on_reject: Callable[[str], None] | None = None, advertise_host: str = ""):
        self.max_bytes = max_bytes
        self.name = name
        self.on_reject = on_reject
        self.rejected = 0
        self._sock = _socket(zmq.ROUTER, hwm, max_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        # peers dial the advertised name: binding 0.0.0.0 (all interfaces) is not an address anyone can reach
        self.endpoint = f"tcp://{advertise_host or host}:{self.port}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fd_lock = threading.Lock()
        self._closed = False
        self.failed = 0  # requests whose handler raised an unexpected error (answered with it)
        self.crashed: str | None = None
        self.on_death: Callable[[str], None] | None = None

    def wake(self) -> None:
        """Run ``tick`` soon; callable from any thread (e.g. when a new weight version is published)."""
        with self._fd_lock:  # never write to a closed descriptor: its number may belong to someone else now
            if not self._closed:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass  # the pipe is full of wake-ups already

    def _close(self) -> None:
        with self._fd_lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        self._sock.send_multipart([identity, *frames], copy=False)

    def _reject(self, identity: bytes, seq: int, reason: str) -> None:
        self.rejected += 1
        log.warning("%s: rejected message: %s", self.name, reason[:500])
        if self.on_reject:
            self.on_reject(reason)
        Reply(self, identity, seq).error(reason[:2000])

    def serve(self, handler: Handler, tick: Callable[[], None] | None = None, poll_ms: int = 20) -> None:
        """Answer requests until ``stop()``. ``tick`` runs after every poll (deadlines of parked requests).

        No message can end this loop: every failure while handling one is answered and counted. Should the loop
        die anyway (a bug), ``crashed`` says why and ``on_death`` tells the service, whose health then fails."""
        try:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            while not self._stop.is_set():
                events = dict(poller.poll(poll_ms))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._sock in events:
                    while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self._handle(self._sock.recv_multipart(copy=False), handler)
                if tick is not None:
                    try:
                        tick()
                    except Exception:  # noqa: BLE001 — a failing tick is logged; the channel keeps serving
                        log.exception("%s: tick failed", self.name)
        except BaseException as exc:
            if not self._stop.is_set():
                self.crashed = f"{exc.__class__.__name__}: {exc}"
                log.critical("%s: data-plane loop died: %s", self.name, self.crashed, exc_info=True)
                if self.on_death is not None:
                    self.on_death(self.crashed)
            raise
        finally:
            self._close()

    def health(self) -> str | None:
        """None while the receiving loop serves, else why it does not (a ServiceRuntime.watch probe)."""
        return None if self.alive else f"the {self.name} data-plane loop died: {self.crashed or 'its thread ended'}"

    @property
    def alive(self) -> bool:
        """The receiving loop runs (or was never started): what the service's health check reports."""
        return self.crashed is None and (self._thread is None or self._thread.is_alive() or self._stop.is_set())

    def _handle(self, frames: list[zmq.Frame], handler: Handler) -> None:
        if not frames:  # (a ROUTER always prepends the sender's identity)
            return
        identity = frames[0].bytes
        try:
            kind, batch = decode(frames[1:], self.max_bytes)
        except FrameError as exc:
            self._reject(identity, 0, f"{self.name}: {exc}")
            return
        progress.received()
        reply = Reply(self, identity, batch.seq)
        try:
            handler(kind, batch, reply)
        except (ValueError, KeyError, FrameError) as exc:
            self._reject(identity, batch.seq, f"{self.name}: '{kind}' refused: {exc}")
        except Exception as exc:  # noqa: BLE001 — the peer must hear about any failure, and we keep serving
            self.failed += 1
            log.exception("%s: handler for '%s' failed", self.name, kind)
            try:
                reply.error(f"{self.name}: '{kind}' failed inside the service: {exc.__class__.__name__}: {exc}")
            except Exception:  # noqa: BLE001 — the answer itself could not be sent: logged, loop goes on
                log.exception("%s: could not answer a failed '%s'", self.name, kind)

    def start(self, handler: Handler, tick: Callable[[], None] | None = None) -> threading.Thread:
        self._thread = threading.Thread(target=self.serve, args=(handler, tick), name=f"{self.name}-data",
                                        daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, join_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_s)
        elif not self._closed:  # never served: nobody else will close it
            self._close()


class DataClient:
    """Requests to one DataServer. Not thread-safe: one client per thread."""

    def __init__(self, endpoint: str, *, max_bytes: int, timeout_s: float = 30.0, hwm: int = 64,
                 peer: str = "peer", fence: str = ""):
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.peer = peer
        self.fence = fence  # the attempt this client works for, stamped on every request (see check_fence)
        self._sock = _socket(zmq.DEALER, hwm, max_bytes)
        self._sock.connect(endpoint)
        self._seq = 0
        self._rcvtimeo = -1

    def send(self, kind: str, batch: TensorBatch | None = None) -> int:
        self._seq += 1
        if self.fence:
            batch = batch if batch is not None else TensorBatch()
            batch.meta = {**batch.meta, FENCE_KEY: self.fence}
        frames = encode(kind, batch, seq=self._seq)
        size = message_bytes(frames)
        if size > self.max_bytes:
            raise FrameError(f"'{kind}' message of {size} bytes exceeds data_plane.max_message_bytes="
                             f"{self.max_bytes}; send smaller batches or raise the bound")
        self._sock.send_multipart(frames, copy=False)
        return self._seq

    def recv(self, seq: int, timeout_s: float | None = None) -> tuple[str, TensorBatch]:
        """Wait for the answer to request ``seq``; answers to older (abandoned) requests are dropped."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            if left_ms != self._rcvtimeo:  # a blocking recv with a timeout: no poller per message
                self._sock.setsockopt(zmq.RCVTIMEO, left_ms)
                self._rcvtimeo = left_ms
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.Again:
                raise PeerTimeout(f"no answer from the {self.peer} at {self.endpoint} within {timeout:.1f}s "
                                  f"(data_plane.timeout_s); is the {self.peer} service alive?") from None
            kind, batch = decode(frames, self.max_bytes)
            progress.received()
            if batch.seq < seq:
                continue
            if kind == "error":
                raise RemoteError(str(batch.meta.get("reason", "unspecified error")))
            return kind, batch

    def request(self, kind: str, batch: TensorBatch | None = None,
                timeout_s: float | None = None) -> tuple[str, TensorBatch]:
        return self.recv(self.send(kind, batch), timeout_s)

    def close(self) -> None:
        self._sock.close(linger=0)
