"""Several hosts on one machine, so that a deployment can be tested as the docs' lab machines run it: each host a
Linux network namespace with its own address, joined by a veth pair to a private bridge in the root namespace,
which also gets an address there (the test process, and the `rlfabric` clients it starts, are one more host).

Services start with `rlfabric serve ROLE` bound to their host's address, as docs/deployment.md ("Lab machines")
starts them: the deployment's token from a file, and gRPC over mutual TLS (certificates of `rlfabric certs` for
every host's address) or, where the test says so, in the clear with `--insecure-plaintext` (the docs' trusted
network). Faults are real network faults:

- ``cut(a, b)``: iptables DROP rules (INPUT from b, OUTPUT to b) inside a's namespace (b's when a is the root
  host), so only that link goes: both hosts still reach every other host. Packets are dropped, not refused, as
  when a cable or a switch goes: TCP retransmits until ``restore``.
- ``throttle(host, rate)``: a tbf qdisc on both ends of the host's veth pair (its egress in its namespace, its
  ingress on the bridge side). This kernel has no netem, so no added delay or loss beyond what the token bucket
  queues and drops.

Names are unique per process (pid), so parallel xdist workers never collide, and whatever a test leaves (service
processes, rules, qdiscs, namespaces, veths, the bridge) is removed however it ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRPC_PORT = 50051  # every host has its own port space: every service uses the docs' coordinator port
_made = 0


class HarnessError(RuntimeError):
    """The harness could not build or drive the network (a command failed), with the command's output."""


def _cmd(*args: str, timeout_s: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable() -> str:
    """Why hosts cannot be made here ('' when they can): root and iproute2 (ip, tc) and iptables are needed."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI runs as root)"
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} here to make hosts and faults: apt-get install iproute2 iptables"
    return ""


@dataclass
class Host:
    """One host: a network namespace (``ns``; '' for the root namespace, where the test process runs)."""

    name: str
    ns: str
    address: str
    veth: str = ""  # the bridge side of its veth pair (its end inside the namespace is eth0)

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` as it runs on this host."""
        return ["ip", "netns", "exec", self.ns, *cmd] if self.ns else list(cmd)

    def run(self, *cmd: str, timeout_s: float = 20, check: bool = True) -> subprocess.CompletedProcess:
        return _cmd(*self.argv(*cmd), timeout_s=timeout_s, check=check)


@dataclass
class Service:
    """One `rlfabric serve` process on a host (it leads its process group)."""

    role: str
    host: Host
    proc: subprocess.Popen
    address: str
    log: Path  # its JSON-lines log (--log-file)
    output: Path  # its stdout and stderr
    port_file: Path

    def tail(self, lines: int = 30) -> str:
        out = []
        for path in (self.output, self.log):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name} ({self.role} on {self.host.name} {self.host.address}, "
                           f"exit {self.proc.poll()}):\n" + "\n".join(text))
        return "\n".join(out)


@dataclass
class Hosts:
    """N hosts on a private bridge; ``root`` is the test process's own. Use as a context manager."""

    names: Sequence[str]
    tmp: Path
    tls: bool = True
    hosts: dict[str, Host] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    clients: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _made
        _made += 1  # several sets of hosts in one process (one test, or one xdist worker's tests) never collide
        tag = f"{os.getpid() % 1_000_000}{chr(ord('a') + _made % 26)}"
        self.tag = tag
        self.bridge = f"rlfb{tag}"
        self.tmp = Path(self.tmp)
        self.logs = self.tmp / "logs"
        self.runs_root = self.tmp / "runs"
        self._cuts: list[tuple[Host, str]] = []
        self._forward_rule: list[str] = []
        self.token_file = self.tmp / "secrets" / "token"
        self.tls_dir = self.tmp / "secrets" / "tls"
        self.coordinator = ""

    # ---- the network ------------------------------------------------------------------------------------------

    def _subnet(self) -> str:
        """A /24 of 10.214.0.0/16 that no interface here uses yet (start from the pid: workers differ)."""
        used = _cmd("ip", "-4", "-o", "addr", "show").stdout
        for k in range(250):
            octet = (os.getpid() + _made + k) % 250
            if f" 10.214.{octet}." not in used:
                return f"10.214.{octet}"
        raise HarnessError("every 10.214.x.0/24 is in use on this machine")

    def _remove_stale(self) -> None:
        """What a killed earlier process of the same pid left (pids are reused): its namespaces and bridge."""
        for i, name in enumerate(self.names):
            _cmd("ip", "link", "del", f"rlf{self.tag}v{i}", check=False)
            _cmd("ip", "netns", "del", f"rlf{self.tag}-{name}", check=False)
        _cmd("ip", "link", "del", self.bridge, check=False)

    def __enter__(self) -> Hosts:
        self._remove_stale()
        subnet = self._subnet()
        try:
            _cmd("ip", "link", "add", self.bridge, "type", "bridge")
            _cmd("ip", "addr", "add", f"{subnet}.1/24", "dev", self.bridge)
            _cmd("ip", "link", "set", self.bridge, "up")
            self.root = Host("root", "", f"{subnet}.1")
            for i, name in enumerate(self.names):
                ns, veth, peer = f"rlf{self.tag}-{name}", f"rlf{self.tag}v{i}", f"rlf{self.tag}p{i}"
                host = Host(name, ns, f"{subnet}.{10 + i}", veth)
                _cmd("ip", "netns", "add", ns)
                self.hosts[name] = host
                _cmd("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
                _cmd("ip", "link", "set", peer, "netns", ns)
                _cmd("ip", "link", "set", veth, "master", self.bridge)
                _cmd("ip", "link", "set", veth, "up")
                _cmd("ip", "-n", ns, "link", "set", peer, "name", "eth0")
                _cmd("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _cmd("ip", "-n", ns, "link", "set", "eth0", "up")
                _cmd("ip", "-n", ns, "link", "set", "lo", "up")
            self._let_the_bridge_forward()
            self.logs.mkdir(parents=True, exist_ok=True)
            self.runs_root.mkdir(parents=True, exist_ok=True)
            self._secrets()
        except BaseException:
            self.close()
            raise
        return self

    def _let_the_bridge_forward(self) -> None:
        """With br_netfilter loaded, bridged frames pass the root namespace's FORWARD chain: where its policy drops
        (a Docker host), accept this bridge's own traffic, and only that, until the hosts go."""
        nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not nf.exists() or nf.read_text().strip() != "1":
            return
        if "-P FORWARD ACCEPT" in _cmd("iptables", "-S", "FORWARD", check=False).stdout:
            return
        self._forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _cmd("iptables", "-I", *self._forward_rule)

    def __getitem__(self, name: str) -> Host:
        return self.root if name == "root" else self.hosts[name]

    def _host(self, host: Host | str) -> Host:
        return self[host] if isinstance(host, str) else host

    def cut(self, a: Host | str, b: Host | str) -> None:
        """Drop every packet between ``a`` and ``b`` (both ways), and only those, until ``restore``."""
        a, b = self._host(a), self._host(b)
        side, other = (a, b) if a.ns else (b, a)
        if not side.ns:
            raise HarnessError("a link needs at least one namespace host")
        for rule in (["INPUT", "-s", other.address, "-j", "DROP"], ["OUTPUT", "-d", other.address, "-j", "DROP"]):
            side.run("iptables", "-I", *rule)
            self._cuts.append((side, " ".join(rule)))

    def restore(self, a: Host | str, b: Host | str) -> None:
        """Undo ``cut(a, b)``."""
        a, b = self._host(a), self._host(b)
        side, other = (a, b) if a.ns else (b, a)
        for host, rule in list(self._cuts):
            if host is side and other.address in rule.split():
                host.run("iptables", "-D", *rule.split())
                self._cuts.remove((host, rule))

    def throttle(self, host: Host | str, rate: str, burst: str = "16kb", latency: str = "400ms") -> None:
        """Every packet to or from ``host`` through a token bucket of ``rate`` (tc's units, e.g. ``1mbit``)."""
        host = self._host(host)
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        _cmd("tc", "-n", host.ns, "qdisc", "replace", "dev", "eth0", *tbf)
        _cmd("tc", "qdisc", "replace", "dev", host.veth, *tbf)

    def unthrottle(self, host: Host | str) -> None:
        host = self._host(host)
        _cmd("tc", "-n", host.ns, "qdisc", "del", "dev", "eth0", "root", check=False)
        _cmd("tc", "qdisc", "del", "dev", host.veth, "root", check=False)

    def reaches(self, a: Host | str, b: Host | str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connect from ``a`` to ``b``:``port`` is answered (accepted or refused) in time."""
        a, b = self._host(a), self._host(b)
        code = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                "timeout=float(sys.argv[3])).close()\nexcept ConnectionRefusedError:\n    pass\n"
                "except OSError:\n    sys.exit(1)")
        return a.run(sys.executable, "-c", code, b.address, str(port), str(timeout_s), check=False,
                     timeout_s=timeout_s + 20).returncode == 0

    # ---- the deployment ---------------------------------------------------------------------------------------

    def _secrets(self) -> None:
        """The deployment's token (a file, owner-only), and with ``tls`` a CA and certificates for every host's
        address made by `rlfabric certs` (docs/deployment.md, "TLS")."""
        import secrets

        self.token_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        if self.tls:
            addresses = ",".join([self.root.address, *(h.address for h in self.hosts.values())])
            made = subprocess.run([sys.executable, "-m", "rlfabric.services.cli", "certs", str(self.tls_dir),
                                   "--hosts", addresses, "--ca-key-dir", str(self.tls_dir.parent / "ca")],
                                  capture_output=True, text=True, timeout=120, cwd=REPO, env=self._env())
            if made.returncode != 0:
                raise HarnessError(f"rlfabric certs failed: {made.stderr[-2000:]}")

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLFABRIC_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        return env

    def client_env(self) -> dict[str, str]:
        """The environment of a client on any host (the CLI, a notebook): the token file, and the CA and client
        certificate (TLS) or the operator's leave to talk in the clear."""
        env = {**self._env(), "RLFABRIC_TOKEN_FILE": str(self.token_file)}
        if self.tls:
            env.update(RLFABRIC_TLS_CA=str(self.tls_dir / "ca.pem"), RLFABRIC_TLS_CERT=str(self.tls_dir / "client.pem"),
                       RLFABRIC_TLS_KEY=str(self.tls_dir / "client.key"))
        else:
            env["RLFABRIC_INSECURE_PLAINTEXT"] = "1"
        return env

    def _security_flags(self) -> list[str]:
        if not self.tls:
            return ["--insecure-plaintext"]
        return ["--tls-cert", str(self.tls_dir / "server.pem"), "--tls-key", str(self.tls_dir / "server.key"),
                "--tls-ca", str(self.tls_dir / "ca.pem")]

    def serve(self, role: str, host: Host | str, *extra: str) -> Service:
        """Start `rlfabric serve ROLE` on ``host``, bound to its address on GRPC_PORT; workers register with the
        coordinator (start it first). Returns at once: ``wait_serving`` waits."""
        host = self._host(host)
        name = f"{role}@{host.name}"
        log, output, port_file = (self.logs / f"{name}.log", self.logs / f"{name}.out",
                                  self.logs / f"{name}.address")
        argv = [sys.executable, "-m", "rlfabric.services.cli", "serve", role, "--host", host.address,
                "--port", str(GRPC_PORT), "--advertise-host", host.address, "--log-file", str(log),
                "--port-file", str(port_file), "--token-file", str(self.token_file), *self._security_flags()]
        if role == "coordinator":
            argv += ["--runs-root", str(self.runs_root)]
        elif role == "robot_gateway":  # arms, not a worker of runs: the env adapter dials it by address
            operator = self.tmp / "secrets" / "operator-token"
            if not operator.exists():
                fd = os.open(operator, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write("the-operators-own-secret\n")
            argv += ["--operator-token-file", str(operator)]
        else:
            if not self.coordinator:
                raise HarnessError(f"start the coordinator before {role}")
            # run directories are the coordinator's, under its runs root: a shared file system here, as the docs
            # ask of lab hosts (every worker's --data-root covers the runs root)
            argv += ["--coordinator", self.coordinator, "--data-root", f"{self.runs_root}{os.pathsep}{REPO}"]
        with open(output, "w") as out:
            proc = subprocess.Popen(host.argv(*argv, *extra), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO, env=self._env(), start_new_session=True)
        service = Service(role, host, proc, f"{host.address}:{GRPC_PORT}", log, output, port_file)
        self.services.append(service)
        if role == "coordinator":
            self.coordinator = service.address
        return service

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Until every service started has written its port file (it serves); fails at once if one exited."""
        deadline = time.monotonic() + timeout_s
        for service in self.services:
            while not service.port_file.exists():
                if service.proc.poll() is not None:
                    raise HarnessError(f"{service.role} on {service.host.name} exited at start-up:\n"
                                       f"{service.tail()}")
                if time.monotonic() > deadline:
                    raise HarnessError(f"{service.role} on {service.host.name} did not serve within "
                                       f"{timeout_s:.0f} s:\n{service.tail()}")
                time.sleep(0.1)

    def client(self, *args: str, log: str = "client") -> tuple[subprocess.Popen, Path]:
        """Start `rlfabric ARGS` in the root namespace (the test's own host) with the client's environment; its
        stdout and stderr go to logs/LOG.out."""
        path = self.logs / f"{log}.out"
        with open(path, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "rlfabric.services.cli", *args], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=self.client_env(),
                                    start_new_session=True)
        self.clients.append(proc)
        return proc, path

    def coordinator_client(self):
        """A CoordinatorClient in this (the root host's) process, with the deployment's token and its TLS identity
        or leave to talk in the clear (process-wide auth settings: tests/conftest.py resets them after the test)."""
        from rlfabric.services.coordinator.client import CoordinatorClient
        from rlfabric.services.core import auth

        token = self.token_file.read_text().strip()
        tls = (auth.TLSFiles(str(self.tls_dir / "client.pem"), str(self.tls_dir / "client.key"),
                             str(self.tls_dir / "ca.pem")) if self.tls else auth.TLSFiles())
        auth.configure(token, tls, not self.tls)
        return CoordinatorClient(self.coordinator, token=token, tls=tls if self.tls else None)

    def tails(self, lines: int = 30) -> str:
        """The end of every service's output and log, and every client's (what a failed test shows)."""
        parts = [s.tail(lines) for s in self.services]
        parts += [f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                  for p in sorted(self.logs.glob("client*.out"))]
        return "\n".join(parts)

    # ---- teardown ---------------------------------------------------------------------------------------------

    def _stop(self, procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
        """SIGTERM each process group, then SIGKILL what is left after ``grace_s``."""
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: children the service started too
            with suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def close(self) -> None:
        """Stop every client and service, then remove rules, qdiscs, namespaces (killing any process still in one:
        only processes this test started live there), veths and the bridge. Safe to call twice."""
        self._stop(self.clients + [s.proc for s in self.services if s.role != "coordinator"])
        self._stop([s.proc for s in self.services if s.role == "coordinator"])
        for host, rule in self._cuts:
            with suppress(HarnessError, subprocess.TimeoutExpired):
                host.run("iptables", "-D", *rule.split())
        self._cuts.clear()
        for host in self.hosts.values():
            pids = _cmd("ip", "netns", "pids", host.ns, check=False).stdout.split()
            for pid in pids:
                with suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            with suppress(HarnessError, subprocess.TimeoutExpired):
                _cmd("ip", "link", "del", host.veth, check=False)
                _cmd("ip", "netns", "del", host.ns, check=False)
        self.hosts.clear()
        with suppress(HarnessError, subprocess.TimeoutExpired):
            _cmd("ip", "link", "del", self.bridge, check=False)
        if self._forward_rule:
            with suppress(HarnessError, subprocess.TimeoutExpired):
                _cmd("iptables", "-D", *self._forward_rule, check=False)
            self._forward_rule = []

    def __exit__(self, *exc) -> None:
        self.close()
