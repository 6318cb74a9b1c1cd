"""The coordinator's web dashboard: runs, live curves, placement, recoveries, workers' health and robot gateways,
served by aiohttp on the coordinator's own event loop (it reads the coordinator's state directly, never a copy).

Access is Jupyter-style. ``DashboardLogin`` (a gRPC call, so it carries the deployment's bearer) mints a login token
that works once: ``/login?token=...`` exchanges it for a session cookie (a random id, HttpOnly, SameSite=Strict,
Secure over TLS). Every other request without that cookie gets 401. Only digests of tokens and session ids are
kept, and the access log records paths, never query strings (where a login token rides).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import socket
import time
from collections import deque
from pathlib import Path

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import (
    common_pb2,
    coordinator_pb2,
    robot_gateway_pb2,
    robot_gateway_pb2_grpc,
)
from rlfabric.services.core.runtime import GRPC_OPTIONS

log = logging.getLogger(__name__)
STATIC = Path(__file__).with_name("dashboard_static")
COOKIE = "rlfabric_session"
LOGIN_TTL_S = 24 * 3600.0  # an unused login URL expires (`rlfabric dashboard` prints a fresh one)
SESSION_TTL_S = 7 * 24 * 3600.0
MAX_LOGINS, MAX_SESSIONS = 64, 256  # outstanding at once; the oldest make room
POLL_S = 1.0  # workers and gateways are asked at most this often, however many tabs poll
CALL_TIMEOUT_S = 0.8
LOGIN_PAGE = ('<!doctype html><meta charset="utf-8"><meta http-equiv="refresh" content="0;url=/">'
              '<title>rlfabric</title><a href="/">logged in: open the dashboard</a>')
# The login answers with a page that navigates on (not a redirect): a login URL clicked in another site's page is a
# cross-site navigation, and a SameSite=Strict cookie would not go with a redirect that is part of it.


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode(errors="replace")).hexdigest()


class Sessions:
    """One-time login tokens and the session ids they become, kept as SHA-256 digests with their expiry."""

    def __init__(self) -> None:
        self.logins: dict[str, float] = {}
        self.sessions: dict[str, float] = {}

    @staticmethod
    def _add(table: dict[str, float], key: str, ttl_s: float, cap: int) -> None:
        now = time.monotonic()
        for k in [k for k, expiry in table.items() if expiry < now]:
            del table[k]
        while len(table) >= cap:  # insertion order: the oldest first
            del table[next(iter(table))]
        table[key] = now + ttl_s

    def login_token(self) -> str:
        token = secrets.token_urlsafe(32)
        self._add(self.logins, _digest(token), LOGIN_TTL_S, MAX_LOGINS)
        return token

    def exchange(self, token: str) -> str | None:
        """A new session id for a valid login token (which is then spent), else None."""
        expiry = self.logins.pop(_digest(token), None)
        if expiry is None or expiry < time.monotonic():
            return None
        session = secrets.token_urlsafe(32)
        self._add(self.sessions, _digest(session), SESSION_TTL_S, MAX_SESSIONS)
        return session

    def valid(self, session: str) -> bool:
        expiry = self.sessions.get(_digest(session)) if session else None
        return expiry is not None and expiry >= time.monotonic()


class PathAccessLogger(AbstractAccessLogger):
    """Logs the method, path and status of logins and refusals; never a query string (a login token rides there),
    and not the page's once-a-second polls."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path == "/login" or response.status >= 400:
            self.logger.info("dashboard %s %s -> %d", request.method, request.path, response.status)


TITLE = re.compile(r"rlfabric-[a-z_]+( run=\S+)?( grpc=:\d+)?")  # runtime.set_process_title's


def process_title(pid: int, host: str, fallback: str) -> str:
    """The process's title as ps shows it when it runs on this host, else what its service titles itself. (Only a
    service's title: a worker reports its own pid, and another process's command line is none of the page's.)"""
    if pid > 0 and host == socket.gethostname():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if TITLE.fullmatch(title):
                return title
        except OSError:
            pass  # gone, or not ours to read: the derived title says the same
    return fallback


def run_summary(run) -> dict:
    unit, total = run.config.progress()
    return {"run_id": run.run_id, "state": coordinator_pb2.RunState.Name(run.state), "reason": run.reason,
            "stage": run.stage, "mode": run.plan, "env_steps": run.env_steps, "iteration": run.iteration,
            "weight_version": run.weight_version, "recoveries": run.recoveries, "unit": unit, "total": total,
            "done": run.env_steps if unit == "env steps" else run.iteration, "started": run.started,
            "parent": run.parent}


def run_events(run, since: int) -> dict:
    """What WatchRun streams: the metric rows from history index ``since`` on, every recovery, the latest logs."""
    history = run.history
    rows, recoveries, logs = [], [], []
    for event in history[since:]:
        if event.HasField("metrics"):
            m = event.metrics
            rows.append({"iteration": m.iteration, "env_steps": m.env_steps, "wall_time_s": m.wall_time_s,
                         "weight_version": m.weight_version, **dict(m.values)})
    for event in history:
        if event.HasField("recovery"):
            r = event.recovery
            recoveries.append({k: getattr(r, k) for k in (
                "attempt", "role", "worker_id", "cause", "discarded", "resumed_from", "resumed_at_iteration",
                "weight_version", "seconds", "time")})
        elif event.HasField("log"):
            logs.append({"level": event.log.level, "message": event.log.message, "time": event.log.time})
    return {"next": len(history), "metrics": rows, "recoveries": recoveries, "logs": logs[-30:]}


class Dashboard:
    def __init__(self, service, host: str, port: int, advertise_host: str, gateways: list[str]):
        self.service, self.host, self.port, self.advertise_host = service, host, port, advertise_host
        self.security = auth.current()
        self.tls = self.security.tls.enabled  # HTTPS with the coordinator's certificate (browsers bring no client's)
        self.gateways = list(dict.fromkeys(gateways))  # named by the operator (--dashboard-gateway)
        self.sessions = Sessions()
        self.runner: web.AppRunner | None = None
        # (worker id, its stage's channel) -> (asked at, version, error): a re-placed run's stages are new ones
        self._versions: dict[tuple[str, int], tuple[float, int | None, str]] = {}
        self._channels: dict[str, object] = {}
        self._gateway_view: tuple[float, list[dict]] = (0.0, [])
        self._jitter: dict[tuple[str, str], deque] = {}

    # -- serving ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=4096)  # nothing here takes a body
        app.router.add_get("/login", self._login)
        app.router.add_get("/", self._index)
        app.router.add_static("/static", STATIC)
        app.router.add_get("/api/overview", self._overview)
        app.router.add_get("/api/runs/{run_id}", self._run)
        app.router.add_get("/api/gateways", self._gateways)
        app.on_response_prepare.append(self._headers)
        self.runner = web.AppRunner(app, access_log_class=PathAccessLogger, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, ssl_context=auth.server_ssl_context(self.security)
                           if self.tls else None)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            why = (f"coordinator: cannot serve the dashboard on {self.host}:{self.port}: {exc}. Fix: "
                   f"--dashboard-port with a free port (0 picks one), or -1 to serve none")
            log.critical(why)
            raise SystemExit(why) from exc
        self.port = self.runner.addresses[0][1]
        if not self.tls and not auth.is_loopback(self.host):
            log.warning("serving the dashboard over plain HTTP on a non-loopback address (--insecure-plaintext): "
                        "anyone on the network can read its login tokens and session cookies")
        log.info("dashboard serving", extra={"dashboard": self.base_url})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        for channel in self._channels.values():
            await channel.close()

    @property
    def base_url(self) -> str:
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def login_url(self) -> str:
        return f"{self.base_url}/login?token={self.sessions.login_token()}"

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        if request.path != "/login" and not self.sessions.valid(request.cookies.get(COOKIE, "")):
            raise web.HTTPUnauthorized(text="401: log in with a login URL: `rlfabric up` prints one, and "
                                            "`rlfabric dashboard --coordinator ADDR` makes a fresh one (each works "
                                            "once)\n")
        return await handler(request)

    @staticmethod
    async def _headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update({"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                                 "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                                 "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'"})

    async def _login(self, request: web.Request) -> web.Response:
        session = self.sessions.exchange(request.query.get("token", ""))
        if session is None:
            raise web.HTTPUnauthorized(text="401: this login token is not valid: each works once. Fix: `rlfabric "
                                            "dashboard --coordinator ADDR` prints a fresh login URL\n")
        response = web.Response(text=LOGIN_PAGE, content_type="text/html")
        response.set_cookie(COOKIE, session, max_age=int(SESSION_TTL_S), path="/", httponly=True, samesite="Strict",
                            secure=self.tls)
        return response

    async def _index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    # -- the JSON the page polls ------------------------------------------------------------------------------
    async def _overview(self, request: web.Request) -> web.Response:
        service = self.service
        me = {"worker_id": "coordinator", "role": "coordinator", "host": socket.gethostname(), "pid": os.getpid(),
              "grpc": service.runtime.address, "alive": True, "since_heartbeat_s": 0.0, "since_progress_s": 0.0,
              "run_id": "", "title": process_title(os.getpid(), socket.gethostname(), "rlfabric-coordinator")}
        now = time.monotonic()
        workers = [me] + [{
            "worker_id": w.worker_id, "role": w.role, "host": w.host, "pid": w.pid, "grpc": w.grpc, "alive": w.alive,
            "since_heartbeat_s": now - w.last_seen, "since_progress_s": now - w.progressed_at, "run_id": w.run_id,
            "title": process_title(w.pid, w.host, " ".join([f"rlfabric-{w.role}", *([f"run={w.run_id}"] if w.run_id
                                                                                     else []),
                                                              f"grpc=:{w.grpc.rsplit(':', 1)[-1]}"]))}
            for w in service.registry.workers.values()]
        return web.json_response({"coordinator": service.runtime.address, "time": time.time(),
                                  "runs": [run_summary(r) for r in service.runs.values()], "workers": workers})

    async def _run(self, request: web.Request) -> web.Response:
        run = self.service.runs.get(request.match_info["run_id"])
        if run is None:
            raise web.HTTPNotFound(text=f"no run {request.match_info['run_id']!r}")
        try:
            since = int(request.query.get("since", "0"))
            if since < 0:
                raise ValueError
        except ValueError:
            raise web.HTTPBadRequest(text=f"since must be a history index >= 0, got "
                                          f"{request.query.get('since')!r}") from None
        return web.json_response({"run": run_summary(run), **run_events(run, since),
                                  "placement": await self.placement(run)})

    async def placement(self, run) -> list[dict]:
        """Which worker on which host does what in the run, with the weight version it holds (asked with GetState,
        at most once a second) and its staleness: how many versions it trails the learner's newest."""
        loop = run.loop
        if loop is None or run.finished:
            return []
        stages = [(role, s) for role, ss in loop.plan.pools.items() for s in ss]
        await asyncio.gather(*(self._ask_version(s) for role, s in stages if role in ("learner", "rollout")))
        versions = {s.worker.worker_id: self._versions.get(_key(s), (0, None, "")) for _, s in stages}
        base = loop.base_version
        learner = next((versions[s.worker.worker_id][1] for role, s in stages if role == "learner"), None)
        rows = []
        for role, s in stages:
            w = s.worker
            _, version, error = versions[w.worker_id]
            rows.append({"role": role, "worker_id": w.worker_id, "host": w.host, "pid": w.pid, "grpc": w.grpc,
                         "alive": w.alive, "weight_version": None if version is None else version - base,
                         "staleness": learner - version if role == "rollout" and None not in (learner, version)
                         else None, "error": error})
        return rows

    async def _ask_version(self, stage) -> None:
        key = _key(stage)
        asked, version, error = self._versions.get(key, (0.0, None, ""))
        if time.monotonic() - asked < POLL_S:
            return
        if len(self._versions) > 4 * len(self.service.registry.workers) + 64:  # stages of placements gone by
            self._versions.clear()
        self._versions[key] = (time.monotonic(), version, error)  # one call at a time, however many tabs ask
        try:
            reply = await stage.stub.GetState(common_pb2.Empty(), timeout=CALL_TIMEOUT_S, metadata=stage.metadata())
            self._versions[key] = (time.monotonic(), reply.weight_version, "")
        except Exception as exc:  # noqa: BLE001 — shown on the page: a worker that does not answer is news
            self._versions[key] = (time.monotonic(), None, _why(exc))

    async def _gateways(self, request: web.Request) -> web.Response:
        asked, view = self._gateway_view
        if time.monotonic() - asked >= POLL_S:
            view = await self.poll_gateways()
            self._gateway_view = (time.monotonic(), view)
        named = sorted({(r.run_id, str(r.config.env.options.get("gateway"))) for r in self.service.runs.values()
                        if not r.finished and r.config.env.options.get("gateway")})
        return web.json_response({"gateways": view, "named_by_runs": [{"run_id": r, "gateway": g} for r, g in named]})

    async def poll_gateways(self) -> list[dict]:
        """The arms of every robot gateway registered with this coordinator or named by --dashboard-gateway: their
        loop jitter (sampled here once a second; the gateway's own metrics have every tick), holds and
        interventions."""
        registered = [w.grpc for w in self.service.registry.workers.values() if w.role == "robot_gateway" and w.alive]
        addresses = list(dict.fromkeys(registered + self.gateways))
        for gone in [a for a in self._channels if a not in addresses]:  # a gateway that left, or moved
            await self._channels.pop(gone).close()
        views = await asyncio.gather(*(self._poll_gateway(a, a in registered) for a in addresses))
        arms = {(v["address"], r["robot_id"]) for v in views for r in v["robots"]}
        self._jitter = {arm: samples for arm, samples in self._jitter.items() if arm in arms}
        return views

    async def _poll_gateway(self, address: str, registered: bool) -> dict:
        view = {"address": address, "registered": registered, "robots": [], "error": ""}
        if address not in self._channels:
            self._channels[address] = auth.aio_channel(address, GRPC_OPTIONS)
        stub = robot_gateway_pb2_grpc.RobotGatewayStub(self._channels[address])
        try:
            robots = (await stub.ListRobots(robot_gateway_pb2.ListRobotsRequest(), timeout=CALL_TIMEOUT_S)).robots
            states = await asyncio.gather(*(stub.GetState(robot_gateway_pb2.RobotRef(robot_id=r.robot_id),
                                                          timeout=CALL_TIMEOUT_S) for r in robots))
        except Exception as exc:  # noqa: BLE001 — shown on the page: an unreachable gateway is news
            view["error"] = _why(exc)
            return view
        for info, s in zip(robots, states, strict=True):
            samples = self._jitter.setdefault((address, info.robot_id), deque(maxlen=120))
            samples.append(s.loop_jitter_s * 1e3)
            view["robots"].append({
                "robot_id": info.robot_id, "driver": info.driver, "control_hz": info.control_hz,
                "jitter_ms": s.loop_jitter_s * 1e3, "jitter_max_ms": max(samples), "jitter_ms_series": list(samples),
                "lateness_ms": s.loop_lateness_s * 1e3, "overruns": s.overruns, "holding": s.holding,
                "hold_reason": s.hold_reason, "estopped": s.estopped, "fault": s.fault, "intervening": s.intervening,
                "episode": s.episode, "episode_intervened_ticks": s.episode_intervened_ticks})
        return view


def _key(stage) -> tuple[str, int]:
    return stage.worker.worker_id, id(stage.channel)


def _why(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return f"{exc.__class__.__name__}: {exc}"
