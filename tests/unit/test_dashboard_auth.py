"""The dashboard's access rules without a browser: 401 without a session, login tokens that work once, the session
cookie's flags (Secure over TLS), and no login token in the access log."""

from __future__ import annotations

import asyncio
import logging
import ssl
from http.cookies import SimpleCookie
from types import SimpleNamespace

import aiohttp
import pytest

from rlfabric.services.coordinator import dashboard
from rlfabric.services.coordinator.dashboard import COOKIE, Dashboard, Sessions
from rlfabric.services.core import auth, certs


def _service():
    """What the dashboard reads of a coordinator: its address, its registry and its runs (none here)."""
    return SimpleNamespace(runtime=SimpleNamespace(address="127.0.0.1:1"), registry=SimpleNamespace(workers={}),
                           runs={})


async def _session_flow(board: Dashboard, ssl_context=None) -> dict:
    """Every request a stranger and a logged-in browser make; what each got."""
    await board.start()
    got: dict = {}
    try:
        connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context else None
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as http:
            base = board.base_url
            for path in ("/", "/api/overview", "/api/runs/x", "/api/gateways", "/static/dashboard.js", "/login",
                         "/login?token=not-a-token"):
                async with http.get(base + path) as r:
                    got[f"stranger {path}"] = r.status
            url = board.login_url()
            got["token"] = url.split("token=", 1)[1]
            async with http.get(url) as r:
                got["login"], got["set-cookie"] = r.status, r.headers.getall("Set-Cookie", [])
            async with http.get(url) as r:
                got["login again"] = r.status
            session = SimpleCookie(got["set-cookie"][0])[COOKIE].value
            got["session"] = session
            for path in ("/", "/api/overview", "/static/dashboard.js"):
                async with http.get(base + path, headers={"Cookie": f"{COOKIE}={session}"}) as r:
                    got[f"session {path}"] = r.status
                    if path == "/api/overview":
                        got["overview"] = await r.json()
            async with http.get(base + "/api/overview", headers={"Cookie": f"{COOKIE}=forged-{session}"}) as r:
                got["forged"] = r.status
            async with http.get(base + "/api/runs/x?since=-1", headers={"Cookie": f"{COOKIE}={session}"}) as r:
                got["unknown run"] = r.status
    finally:
        await board.stop()
    return got


def _check_refusals(got: dict) -> None:
    assert {k: v for k, v in got.items() if k.startswith("stranger")} == {
        k: 401 for k in got if k.startswith("stranger")}
    assert got["login"] == 200 and got["login again"] == 401  # one use
    assert got["session /"] == got["session /api/overview"] == got["session /static/dashboard.js"] == 200
    assert got["overview"]["runs"] == [] and got["overview"]["workers"][0]["role"] == "coordinator"
    assert got["forged"] == 401 and got["unknown run"] == 404
    assert got["session"] != got["token"] and len(got["session"]) >= 40  # a random id, not the token


def test_without_tls_401s_one_time_token_cookie_flags_and_no_token_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    got = asyncio.run(_session_flow(Dashboard(_service(), "127.0.0.1", 0, "127.0.0.1", [])))
    _check_refusals(got)
    [cookie] = got["set-cookie"]
    flags = {f.strip().split("=")[0].lower(): f.strip() for f in cookie.split(";")[1:]}
    assert "httponly" in flags and flags["samesite"] == "SameSite=Strict" and flags["path"] == "Path=/"
    assert "secure" not in flags  # plain HTTP on loopback: a Secure cookie would never come back
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any("/login -> 200" in line for line in access) and any("/login -> 401" in line for line in access)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert got["token"] not in text and got["session"] not in text and "token=" not in text


def test_over_tls_the_cookie_is_secure(tmp_path, monkeypatch):
    paths = certs.generate(tmp_path / "tls", ["127.0.0.1", "localhost"])
    monkeypatch.setattr(auth, "_current", auth.Security("a-deployment-secret-1234", certs.service_files(paths)))
    board = Dashboard(_service(), "127.0.0.1", 0, "127.0.0.1", [])
    assert board.base_url.startswith("https://")
    got = asyncio.run(_session_flow(board, ssl.create_default_context(cafile=str(paths["ca.pem"]))))
    _check_refusals(got)
    assert "Secure" in [f.strip() for f in got["set-cookie"][0].split(";")]


def test_login_tokens_expire_and_outstanding_ones_are_bounded(monkeypatch):
    sessions = Sessions()
    stale = sessions.login_token()
    monkeypatch.setattr(dashboard, "LOGIN_TTL_S", -1.0)  # minted already expired
    expired = sessions.login_token()
    assert sessions.exchange(expired) is None
    assert sessions.valid(sessions.exchange(stale))
    monkeypatch.setattr(dashboard, "LOGIN_TTL_S", 60.0)
    tokens = [sessions.login_token() for _ in range(dashboard.MAX_LOGINS + 5)]
    assert len(sessions.logins) == dashboard.MAX_LOGINS
    assert sessions.exchange(tokens[0]) is None and sessions.exchange(tokens[-1]) is not None
    assert not sessions.valid("") and not sessions.valid("made-up")


def test_a_dashboard_port_in_use_stops_the_coordinator_with_the_reason():
    async def clash() -> str:
        first = Dashboard(_service(), "127.0.0.1", 0, "127.0.0.1", [])
        await first.start()
        try:
            with pytest.raises(SystemExit) as stopped:
                await Dashboard(_service(), "127.0.0.1", first.port, "127.0.0.1", []).start()
            return str(stopped.value)
        finally:
            await first.stop()

    why = asyncio.run(clash())
    assert "cannot serve the dashboard" in why and "--dashboard-port" in why
