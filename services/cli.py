"""rlfabric command line.

  rlfabric train CONFIG [--run-dir DIR] [--set key=value ...] [--coordinator HOST:PORT]
  rlfabric resume RUN_DIR [--coordinator HOST:PORT]   continue a run from its newest valid checkpoint
  rlfabric up [--runs-root DIR] [--tls auto]          start every service locally and keep serving
  rlfabric certs OUT_DIR --hosts h1,h2                a private CA and the services' and clients' certificates
  rlfabric scrape-token                               the metrics credential derived from the deployment's secret
  rlfabric serve SERVICE --coordinator HOST:PORT      one service (for multi-host deployments)
  rlfabric status --coordinator HOST:PORT             workers and runs
  rlfabric dashboard --coordinator HOST:PORT          a fresh one-time login URL of the coordinator's web dashboard
  rlfabric stop RUN_ID --coordinator HOST:PORT
  rlfabric scale RUN_ID rollout +1 --coordinator HOST:PORT [--spawn]   online scaling of a live run
  rlfabric plan CONFIG --cluster rollout=24,learner=8 --profile RUN_DIR   rank plans on a cluster (simulator)
  rlfabric eval CHECKPOINT [--episodes N]             play episodes with a saved policy
  rlfabric collect SOURCE --out FILE.npz [--random|--expert]   write an offline data set of transitions

Exit codes: 0 success, 2 bad input (reason on stderr), 1 anything else.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[1:2] in (["train"], ["resume"]) and not any(
        a == "--coordinator" or a.startswith("--coordinator=") for a in sys.argv):
    # local services: their forkserver starts importing now, beside this process's own imports (rich, pydantic)
    from rlfabric.services.launcher import prestart

    prestart()

import argparse
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape as rich_escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rlfabric.services.core import auth

console = Console(stderr=True)
SERVICES = ("coordinator", "learner", "rollout", "env", "replay")


def _load(path, overrides: list[str] | None = None):
    """The validated run spec (imports the algorithm specs, torch with them: for commands without local services)."""
    from rlfabric.services.core.config import load_config

    return load_config(path, overrides)


def _fail(message: str, code: int) -> int:
    console.print(f"[bold red]error:[/] {rich_escape(message)}", highlight=False, soft_wrap=True)
    return code


def _local_stack(spec: str | Path, overrides: list[str], run_dir, log_dir, what: str):
    """Start a local stack for a spec: the coordinator first, the spec validated (in a forkserver child, see
    launcher.describe_spec) while it comes up, then the workers the spec's plan needs. Returns (stack, facts), or
    an exit code after saying why (an invalid spec leaves no run directory behind)."""
    from rlfabric.services.core.spec_yaml import ConfigError, read_spec_file
    from rlfabric.services.launcher import LocalStack, describe_spec

    try:  # the cheap read (no schema, no torch): the run's name and thread count, to start the coordinator
        raw = read_spec_file(spec, overrides)
    except ConfigError as exc:
        return _fail(f"{what}{exc}", 2)
    name = raw.get("name") if isinstance(raw.get("name"), str) else "run"
    threads = (raw.get("runtime") or {}).get("torch_threads", 1) if isinstance(raw.get("runtime"), dict) else 1
    run_dir = run_dir(name).resolve()
    fresh = not run_dir.exists()
    stack = LocalStack(log_dir=log_dir(run_dir), runs_root=run_dir.parent, roles=(), allow_import_paths=True,
                       torch_threads=threads if isinstance(threads, int) and 1 <= threads <= 256 else 1)
    try:
        with console.status("starting services..."):
            stack.spawn_coordinator()
            facts = describe_spec(spec, overrides)
            if "error" not in facts:
                stack.torch_threads, stack.roles = facts["torch_threads"], tuple(facts["roles"])
                stack.spawn_workers(stack.roles)
                stack.wait_coordinator()
    except BaseException:
        stack.stop()
        raise
    if "error" in facts:
        stack.stop()
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        return _fail(f"{what}{facts['error']}", 2)
    facts["run_dir"] = run_dir
    stack.supervise()  # a worker that dies is started again (the run in flight decides what to do about its loss)
    return stack, facts


def cmd_train(args: argparse.Namespace) -> int:
    """A run: on the coordinator at --coordinator, or on a local stack of services started for it (``up``, then
    ``submit``, then ``watch``: the same calls a notebook makes, so a spec gets the same run either way, its
    warm_start stages included: the coordinator runs them)."""
    if args.coordinator:  # where the run lives is the coordinator's: under its runs root
        from rlfabric.services.core.config import ConfigError

        try:
            config = _load(args.config, args.set)
        except ConfigError as exc:
            return _fail(str(exc), 2)
        return _follow(args.coordinator, args, Path(args.run_dir) if args.run_dir else None, None, config.progress())
    from rlfabric.services.launcher import prestart

    prestart()  # the forkserver's imports (torch) start now, while the CLI reads the spec
    return _train_local(args)


def _train_local(args: argparse.Namespace) -> int:
    """One run on a local stack of services, followed to its end."""
    try:
        started = _local_stack(args.config, args.set, lambda name: Path(args.run_dir) if args.run_dir else Path(
            args.runs_root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}", lambda run_dir: run_dir / "logs", "")
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    if isinstance(started, int):
        return started
    stack, facts = started
    try:
        return _follow(stack.address, args, facts["run_dir"], stack, tuple(facts["progress"]))
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    finally:
        stack.stop()


def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    args.config, args.set = str(run_dir / "config.yaml"), []
    if args.coordinator:
        from rlfabric.services.core.config import ConfigError

        try:
            config = _load(run_dir / "config.yaml")
        except ConfigError as exc:
            return _fail(f"cannot resume {run_dir}: {exc}", 2)
        return _follow(args.coordinator, args, run_dir, None, config.progress(), resume=True)
    from rlfabric.services.launcher import prestart

    prestart()
    if not run_dir.is_dir():
        return _fail(f"cannot resume {run_dir}: no such run directory. Fix: pass a directory `rlfabric train` "
                     f"made (it holds config.yaml and checkpoints/)", 2)
    try:
        started = _local_stack(args.config, [], lambda _: run_dir, lambda d: d / "logs" / time.strftime(
            "resume-%Y%m%d-%H%M%S"), f"cannot resume {run_dir}: ")
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    if isinstance(started, int):
        return started
    stack, facts = started
    try:
        return _follow(stack.address, args, facts["run_dir"], stack, tuple(facts["progress"]), resume=True)
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    finally:
        stack.stop()


def _await_workers(client, stack, timeout_s: float = 30.0) -> None:
    """Wait (briefly) until every worker of a local stack has registered. The coordinator places a submitted run
    once the workers it needs are registered, looking again every 0.1 s; submitting once they are all in spares
    the first iteration most of one such wait. Returns early if a service died: the run then reports it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not stack.dead():
        if sum(w.alive for w in client.workers()) >= len(stack.roles):
            return
        time.sleep(0.005)


def _follow(address: str, args: argparse.Namespace, run_dir: Path | None, stack, total: tuple[str, int],
            resume: bool = False) -> int:
    import grpc

    from rlfabric.services.coordinator.client import STATE_NAMES, CoordinatorClient

    client = CoordinatorClient(address)
    try:
        client.wait_ready(30)
        if stack is not None:
            _await_workers(client, stack)
        status = client.resume(run_dir) if resume else client.submit(Path(args.config), args.set, run_dir)
    except grpc.RpcError as exc:
        code = 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        return _fail(exc.details() or str(exc), code)
    run_id = status.run_id
    run_dir = Path(status.run_dir)  # as the coordinator placed it (under its runs root)
    console.print(f"run [bold]{run_id}[/] -> {run_dir}  (coordinator {address})", soft_wrap=True)
    stopping: list[bool] = []

    def stop(*_) -> None:  # Ctrl-C or SIGTERM: stop the run (it checkpoints) and report, don't just die
        if not stopping:
            stopping.append(True)
            threading.Thread(target=client.stop, args=(run_id,), daemon=True).start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    final = None
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("return {task.fields[ret]}  eval {task.fields[eval]}  {task.fields[fps]} steps/s  "
                          "v{task.fields[version]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False, disable=args.quiet) as progress:
        unit, count = total
        task = progress.add_task(unit, total=count, ret="-", eval="-", fps="-", version=0)
        for event in client.watch(run_id):
            kind = event.WhichOneof("event")
            if kind == "metrics":
                m = event.metrics
                v = m.values
                progress.update(task, completed=m.env_steps if unit == "env steps" else m.iteration,
                                version=m.weight_version,
                                ret=f"{v['train_return_mean']:.1f}" if "train_return_mean" in v else "-",
                                eval=f"{v['eval_return_mean']:.1f}" if "eval_return_mean" in v else
                                progress.tasks[0].fields["eval"],
                                fps=f"{v.get('fps', 0):.0f}")
            elif kind == "log":
                progress.console.print(f"[dim]{rich_escape(event.log.message)}[/]", highlight=False, soft_wrap=True)
            elif kind == "status":
                final = event.status
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    final = client.status(run_id) if final is None else final
    state = STATE_NAMES.get(final.state, str(final.state))
    if stack is not None and (stack.dead() or stack.restarts):
        console.print(f"[yellow]services that exited during the run: {stack.dead()}, restarted: {stack.restarts} "
                      f"(logs in {run_dir / 'logs'})")
    if final.state == 3:  # SUCCEEDED
        console.print(f"[bold green]{state}[/] {rich_escape(final.reason)}\n  metrics: {run_dir / 'metrics.csv'}  "
                      f"curve: {run_dir / 'curve.png'}  checkpoint: {run_dir / 'checkpoints'}", soft_wrap=True)
        return 0
    return _fail(f"run {state}: {final.reason}", 2 if final.bad_input else 1)


def cmd_up(args: argparse.Namespace) -> int:
    from rlfabric.services.launcher import LocalStack

    tls, tls_note = None, ""
    if args.tls == "auto":
        from rlfabric.services.core import certs

        tls_dir = Path(args.runs_root) / ".rlfabric" / "tls"
        paths = certs.existing(tls_dir) or certs.generate(tls_dir, certs.local_hosts(args.host))
        tls, client = certs.service_files(paths), certs.client_files(paths)
        tls_note = (f"\n  gRPC is mTLS and metrics HTTPS with the CA in {tls_dir} (delete it to make a new one): "
                    f"clients also set RLFABRIC_TLS_CA={Path(client.ca).resolve()} "
                    f"RLFABRIC_TLS_CERT={Path(client.cert).resolve()} RLFABRIC_TLS_KEY={Path(client.key).resolve()}")
    elif not auth.is_loopback(args.host) and not args.insecure_plaintext:
        return _fail(f"refusing to serve on {args.host} without TLS: every call would carry the stack's bearer in "
                     f"clear. Fix: --tls auto (a private CA for this stack), bind 127.0.0.1, or pass "
                     f"--insecure-plaintext on a network you trust", 2)
    if not -1 <= args.dashboard_port <= 65535:
        return _fail(f"--dashboard-port {args.dashboard_port}: a port 0-65535 (0 = pick one) or -1 (none)", 2)
    dashboard_port = args.dashboard_port or _free_port(args.host)  # fixed: a restarted coordinator serves it again
    stack = LocalStack(log_dir=Path(args.runs_root) / "logs", runs_root=args.runs_root, host=args.host,
                       take_up_runs=True, tls=tls, insecure_plaintext=args.insecure_plaintext,
                       allow_import_paths=args.allow_import_paths, dashboard_port=dashboard_port)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # explicit: a background job may inherit SIGINT as ignored
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        try:
            address = stack.start()
        except RuntimeError as exc:
            return _fail(str(exc), 1)
        stack.supervise()  # restart policy on-failure: a dead worker comes back, up to 5 times with back-off
        token_file = auth.write_token_file(Path(args.runs_root) / ".rlfabric" / "token", stack.token)
        scrape_file = auth.write_token_file(Path(args.runs_root) / ".rlfabric" / "scrape-token",
                                            auth.Security(stack.token).scrape_token)
        console.print(f"rlfabric is up: coordinator at [bold]{address}[/]; logs in {stack.log_dir}. Ctrl-C stops.\n"
                      f"  its secret is in {token_file} (owner-only): clients use it with "
                      f"RLFABRIC_TOKEN_FILE={token_file.resolve()} or rlfabric.Client(address, token_file=...); "
                      f"Prometheus scrapes with the token in {scrape_file}{tls_note}", soft_wrap=True)
        print(address, flush=True)
        if dashboard_port >= 0:  # stdout, unwrapped: a one-time login URL, Jupyter-style
            import grpc

            try:
                print(f"dashboard: {_dashboard_login(address)}", flush=True)
            except grpc.RpcError as exc:
                return _fail(f"the coordinator gave no dashboard login ({exc.code().name}: {exc.details()}); see "
                             f"{stack.log_dir / 'coordinator.log'}", 1)
        while not stop:
            dead = stack.dead()  # supervised: only what exited for good, the coordinator included
            if dead:
                return _fail(f"services exited for good: {dead}; see {stack.log_dir}", 1)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
    return 0


def _free_port(host: str) -> int:
    """A port free on ``host`` now (``up`` gives it to the coordinator's dashboard)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _dashboard_login(address: str) -> str:
    """A one-time login URL of the coordinator's dashboard (DashboardLogin carries the deployment's bearer)."""
    from rlfabric.services.coordinator.client import CoordinatorClient
    from rlfabric.services.core.proto.rlfabric.v1 import common_pb2

    with CoordinatorClient(address) as client:
        return client.stub.DashboardLogin(common_pb2.Empty(), timeout=client.timeout_s).url


def cmd_dashboard(args: argparse.Namespace) -> int:
    """A fresh login URL of a coordinator's web dashboard, for an operator holding the deployment's secret."""
    import grpc

    try:
        auth.from_environment(args.token_file)
        print(_dashboard_login(args.coordinator))
    except auth.AuthError as exc:
        return _fail(str(exc), 2)
    except grpc.RpcError as exc:
        return _fail(f"{exc.code().name}: {exc.details()}", 2 if exc.code() in (
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED) else 1)
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    """A private CA and certificates for a deployment (services/core/certs.py)."""
    from rlfabric.services.core import certs

    out, key_dir = Path(args.out_dir), args.ca_key_dir or None
    if certs.existing(out, key_dir) and args.if_missing:  # a compose one-shot: made on the first `up`, kept after
        print(out)
        return 0
    if certs.existing(out, key_dir) and not args.force:
        return _fail(f"{out} already holds a deployment CA and certificates; pass --force to replace them (every "
                     f"service and client then needs the new files)", 2)
    hosts = [*args.hosts.split(","), *(certs.LOOPBACK if not args.no_loopback else ())]
    try:
        paths = certs.generate(out, list(dict.fromkeys(h.strip() for h in hosts if h.strip())), args.days, key_dir)
    except auth.AuthError as exc:
        return _fail(str(exc), 2)
    console.print(f"CA, services' and clients' certificates in {out} (keys owner-only; keep {paths['ca.key']} "
                  f"offline: it mints any service's identity):\n"
                  f"  services: --tls-cert {paths['server.pem']} --tls-key {paths['server.key']} "
                  f"--tls-ca {paths['ca.pem']}\n"
                  f"  clients:  RLFABRIC_TLS_CERT={paths['client.pem']} RLFABRIC_TLS_KEY={paths['client.key']} "
                  f"RLFABRIC_TLS_CA={paths['ca.pem']}", soft_wrap=True)
    print(out)
    return 0


def cmd_scrape_token(args: argparse.Namespace) -> int:
    """The metrics scrape token of the deployment's secret (what Prometheus' credentials_file holds)."""
    try:
        security = auth.from_environment(args.token_file)
    except auth.AuthError as exc:
        return _fail(str(exc), 2)
    if not security.enabled:
        return _fail("no deployment secret: set RLFABRIC_TOKEN_FILE (or RLFABRIC_TOKEN), or pass --token-file", 2)
    print(security.scrape_token)
    return 0


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    standalone = ("coordinator", "robot_gateway")  # a robot gateway serves its robots with or without a coordinator
    rank_host = args.service == "learner" and ("--rank-host-for" in rest or any(
        a.startswith("--rank-host-for=") for a in rest) or os.environ.get("RLFABRIC_RANK_HOST_FOR"))  # its learner's
    if args.service not in standalone and not rank_host and "--coordinator" not in rest and not os.environ.get(
            "RLFABRIC_COORDINATOR"):
        return _fail(f"serve {args.service} needs --coordinator HOST:PORT (or RLFABRIC_COORDINATOR)", 2)
    policy = argparse.ArgumentParser(add_help=False)
    policy.add_argument("--restart", choices=("no", "on-failure"), default="no")
    policy.add_argument("--max-restarts", type=int, default=5)
    restart, rest = policy.parse_known_args(rest)
    if restart.restart == "on-failure":  # this process supervises; the service runs in a child
        from rlfabric.services.launcher import serve_supervised

        if restart.max_restarts < 0:
            return _fail("--max-restarts must be >= 0", 2)
        return serve_supervised([sys.executable, "-m", "rlfabric.services.cli", "serve", args.service, *rest],
                                restart.max_restarts)
    importlib.import_module(f"rlfabric.services.{args.service}.server").main(rest)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rlfabric.services.coordinator.client import STATE_NAMES, CoordinatorClient
    from rlfabric.services.core.runtime import ROLE_NAMES

    with CoordinatorClient(args.coordinator) as client:
        workers, runs = client.workers(), client.runs()
    table = Table(title=f"workers at {args.coordinator}")
    for col in ("id", "role", "grpc", "data", "pid", "alive", "run"):
        table.add_column(col)
    for w in workers:
        table.add_row(w.worker_id, ROLE_NAMES.get(w.role, "?"), w.endpoint.grpc, w.endpoint.data, str(w.pid),
                      "yes" if w.alive else "NO", w.run_id)
    Console().print(table)
    runs_table = Table(title="runs")
    for col in ("run", "state", "stage", "mode", "env steps", "version", "reason"):
        runs_table.add_column(col)
    for r in runs:  # stage: a warm_start stage before the run itself ("run" once the run itself trains)
        runs_table.add_row(r.run_id, STATE_NAMES.get(r.state, "?"), r.stage or "run", r.mode, str(r.env_steps),
                           str(r.weight_version), r.reason)
    Console().print(runs_table)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from rlfabric.services.coordinator.client import STATE_NAMES, CoordinatorClient

    with CoordinatorClient(args.coordinator) as client:
        status = client.stop(args.run_id)
    console.print(f"{status.run_id}: {STATE_NAMES.get(status.state)} {status.reason}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """Add or remove workers of a role in a live run; with --spawn, start the new local workers first."""
    import grpc

    from rlfabric.services.coordinator.client import CoordinatorClient

    text = args.count.strip()
    try:
        value = int(text)
    except ValueError:
        return _fail(f"count {text!r}: expected +N / -N (relative) or N (absolute), e.g. +1", 2)
    relative = text[0] in "+-"
    with CoordinatorClient(args.coordinator) as client:
        try:
            current = client.plan(args.run_id)
        except grpc.RpcError as exc:
            return _fail(exc.details() or str(exc), 2 if exc.code() == grpc.StatusCode.NOT_FOUND else 1)
        spawn = max(0, value) if relative else 0
        if args.spawn and spawn:
            log_dir = Path(args.log_dir)
            from rlfabric.services.launcher import open_private_log, private_dir

            private_dir(log_dir)
            for n in range(spawn):
                log = os.fdopen(open_private_log(log_dir / f"{args.role}-scaled-{os.getpid()}-{n}.log"), "w")
                import subprocess

                subprocess.Popen([sys.executable, "-m", f"rlfabric.services.{args.role}.server", "--coordinator",
                                  args.coordinator], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            console.print(f"started {spawn} {args.role} worker(s); logs in {log_dir}")
        try:
            reply = client.scale(args.run_id, args.role, delta=value if relative else 0,
                                 count=0 if relative else value, timeout_s=args.timeout)
        except grpc.RpcError as exc:
            return _fail(exc.details() or str(exc), 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1)
    console.print(f"{args.run_id}: {reply.workers} {reply.role} worker(s) from iteration "
                  f"{reply.applied_at_iteration} (was plan {current.plan}); {reply.detail}", soft_wrap=True)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Rank the candidate plans of a run spec on a cluster with the simulator, from a measured stage profile."""
    import json

    from rlfabric.services.coordinator.simulator import StageProfile, candidate_plans, parse_cluster, rank
    from rlfabric.services.core.config import ConfigError

    try:
        config = _load(args.config, args.set)
        pools = parse_cluster(args.cluster)
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc), 2)
    path = Path(args.profile)
    if path.is_dir():
        path = path / "plan.json"
    if not path.is_file():
        return _fail(f"--profile {args.profile}: no plan.json there. Fix: run the spec once with "
                     f"--set scheduling.mode=auto (it measures the stages and writes <run_dir>/plan.json)", 2)
    try:
        profile = StageProfile(**json.loads(path.read_text())["profile"])
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        return _fail(f"{path}: not a stage profile written by a mode-auto run ({exc})", 2)
    T, N = config.spec.steps_per_env(config.algorithm), config.env.num_envs
    ranked = rank(profile, candidate_plans(N, T, pools, staleness_options=(config.scheduling.staleness,)), pools)
    table = Table(title=f"plans for {config.name} on {args.cluster} (profile {path}; units = {profile.device})")
    for col in ("#", "plan", "s/iteration", "env steps/s", "busiest pool"):
        table.add_column(col)
    for n, (plan, pred) in enumerate(ranked[:args.top], 1):
        table.add_row(str(n), plan.name, f"{pred.iteration_s:.4g}", f"{pred.env_steps_per_s:,.0f}",
                      f"{pred.bottleneck} {pred.utilisation[pred.bottleneck]:.0%}")
    Console().print(table)
    best, pred = ranked[0]
    print(json.dumps({"best": best.name, "iteration_s": pred.iteration_s, "env_steps_per_s": pred.env_steps_per_s}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rlfabric.services.rollout.evaluate import evaluate_checkpoint

    try:
        evaluation = evaluate_checkpoint(args.checkpoint, args.episodes, args.seed, args.deterministic, args.set)
    except (FileNotFoundError, ValueError) as exc:
        return _fail(str(exc), 2)
    returns, successes = evaluation.returns, evaluation.successes
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
    success = f", success rate {sum(successes) / len(successes):.2f}" if successes else ""
    mode = "deterministic" if evaluation.deterministic else "stochastic"
    console.print(f"{len(returns)} {mode} episodes: mean return {mean:.2f} +/- {std:.2f} "
                  f"(min {min(returns):.1f}, max {max(returns):.1f}){success}")
    print(f"{mean:.4f}")
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    """Write an offline data set (.npz of transitions) from a checkpoint's policy, uniform random actions, or the
    env's scripted expert."""
    from rlfabric.services.core.batch import TensorBatch
    from rlfabric.services.replay.datasets import DatasetError, load_dataset, save_dataset
    from rlfabric.services.rollout.evaluate import collect_dataset, merge_datasets

    try:
        batch, returns = collect_dataset(args.source, args.episodes, args.seed, random=args.random,
                                         deterministic=args.deterministic, expert=args.expert)
        out = Path(args.out)
        if args.append and out.exists():
            old = load_dataset(out, max_rows=1 << 40)
            batch = merge_datasets([TensorBatch(old.tensors, dims=("sample",)), batch])
        path = save_dataset(out, batch)
    except (FileNotFoundError, ValueError, DatasetError) as exc:  # (ConfigError and DatasetError are ValueErrors)
        return _fail(str(exc), 2)
    mean = sum(returns) / len(returns)
    console.print(f"{len(returns)} episodes (mean return {mean:.2f}), {batch.rows} transitions -> {path}")
    print(path)
    return 0


def _key_map(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        env_key, sep, feature = pair.partition("=")
        if not sep or not env_key or not feature:
            raise ValueError(f"--key {pair!r}: give <env observation key>=<LeRobot feature>, e.g. "
                             f"image=observation.images.top")
        out[env_key] = feature
    return out


def _import_lerobot(root: str, config, keys: dict[str, str], episodes: int, out: Path) -> Path:
    """A LeRobot data set as the env's demonstrations (services/env/lerobot_data.py), written as an .npz data set,
    with the videos' decoding shown."""
    from rlfabric.services.env.lerobot_data import import_for_run
    from rlfabric.services.replay.datasets import save_dataset

    with Progress(TextColumn("decoding {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(f"{what} (video files)", total=total)
            bar.update(tasks[what], completed=done)

        batch, summary = import_for_run(root, config, keys, episodes, progress)
    path = save_dataset(out, batch)
    outside = summary["actions_out_of_bounds"]
    console.print(f"{summary['episodes']} LeRobot episodes ({summary['frames']} frames, {summary['tasks']} tasks) -> "
                  f"{summary['transitions']} chunks of {summary['chunk']} -> {path}; features: {summary['keys']}"
                  + (f"; {outside:.1%} of action values lie outside the env's bounds" if outside else ""))
    return path


def cmd_import_lerobot(args: argparse.Namespace) -> int:
    """Write a LeRobot data set's episodes as an .npz data set of a run's env (its observation format, its
    action chunks, its instruction encoding), for replay.datasets or a supervised stage."""
    from rlfabric.services.core.config import ConfigError

    try:
        config = _load(args.spec, args.set)
        _import_lerobot(args.dataset, config, _key_map(args.key), args.episodes, Path(args.out))
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc), 2)
    return 0


def cmd_teleop(args: argparse.Namespace) -> int:
    """A human (keyboard) or the scripted reach expert takes over robots on a gateway (see
    services/robot_gateway/teleop.py)."""
    import threading

    import numpy as np

    from rlfabric.services.core import auth
    from rlfabric.services.robot_gateway import teleop

    def point(text: str, what: str) -> np.ndarray:
        try:
            values = np.array([float(v) for v in text.split(",")])
        except ValueError:
            values = np.array([])
        if not len(values) or not np.isfinite(values).all():
            raise ValueError(f"{what}={text!r}: give comma-separated numbers")
        return values

    try:
        auth.from_environment(args.token_file)
        if args.expert_goal:
            from rlfabric.services.robot_gateway.drivers import build_driver

            goal, start = point(args.expert_goal, "--expert-goal"), point(args.start, "--start")
            if len(goal) != 3:
                raise ValueError(f"--expert-goal={args.expert_goal!r}: give x,y,z in metres")
            kinematics = build_driver(args.driver, {}).forward_kinematics  # the arm's model, never connected
            stop = threading.Event()
            console.print(f"expert on every robot of {args.gateway}: goal {goal.tolist()} (Ctrl-C stops)")
            try:
                experts = teleop.run_expert(args.gateway, goal, start, kinematics, stop,
                                            start_tolerance=args.start_tolerance)
            except KeyboardInterrupt:
                stop.set()
                return 0
            console.print({rid: e.takeovers for rid, e in experts.items()})
            return 0
        if not args.robot:
            raise ValueError("give --robot ID (keyboard teleop of one robot) or --expert-goal X,Y,Z")
        keys = sys.stdin
        if sys.stdin.isatty():  # raw keys, no Enter needed
            import termios
            import tty

            saved = termios.tcgetattr(sys.stdin)
            tty.setcbreak(sys.stdin)
            try:
                teleop.run_keyboard(args.gateway, args.robot, keys, sys.stdout, args.step)
            finally:
                termios.tcsetattr(sys.stdin, termios.TCSADRAIN, saved)
        else:
            teleop.run_keyboard(args.gateway, args.robot, keys, sys.stdout, args.step)
    except ValueError as exc:
        return _fail(str(exc), 2)
    return 0


def cmd_robot(args: argparse.Namespace) -> int:
    """What only the operator of a robot gateway does (``clear-estop``): the call carries a credential derived from
    the operator's own secret, which no run holds."""
    import grpc

    from rlfabric.services.core import auth
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
    from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS

    path = args.operator_token_file or os.environ.get(auth.OPERATOR_TOKEN_FILE_ENV, "")
    if not path:
        return _fail(f"clearing an e-stop takes the operator's secret: give --operator-token-file FILE (or "
                     f"{auth.OPERATOR_TOKEN_FILE_ENV}), the file the gateway's --operator-token-file names", 2)
    try:
        auth.from_environment(args.token_file)
        operator = auth.read_token_file(path)
    except auth.AuthError as exc:
        return _fail(str(exc), 2)
    with auth.sync_channel(args.gateway, GRPC_OPTIONS) as channel:
        try:
            state = robot_gateway_pb2_grpc.RobotGatewayStub(channel).ClearEStop(
                pb.RobotRef(robot_id=args.robot_id), timeout=15,
                metadata=((auth.OPERATOR_METADATA_KEY, auth.operator_credential(operator)),))
        except grpc.RpcError as exc:
            return _fail(f"{exc.code().name}: {exc.details()}", 1)
    console.print(f"{args.robot_id}: e-stop and faults cleared; the arm holds ({state.hold_reason or 'hold'}) "
                  f"until a fresh command", soft_wrap=True)
    return 0


def cmd_export_lerobot(args: argparse.Namespace, rest: list[str]) -> int:
    from rlfabric.services.robot_gateway.export import main as export_main

    return int(export_main(rest) or 0)


def _client_tls(parser: argparse.ArgumentParser) -> None:
    """TLS of a client of a deployment's services: each flag is its RLFABRIC_TLS_* variable (set from it)."""
    parser.add_argument("--tls-ca", default="", help="the deployment CA (servers are verified with it) "
                                                     "[env RLFABRIC_TLS_CA]")
    parser.add_argument("--tls-cert", default="", help="a client certificate the CA signed, for mTLS services "
                                                       "[env RLFABRIC_TLS_CERT]")
    parser.add_argument("--tls-key", default="", help="the key of --tls-cert [env RLFABRIC_TLS_KEY]")


def _apply_client_tls(args: argparse.Namespace) -> None:
    for what in ("ca", "cert", "key"):
        value = getattr(args, f"tls_{what}", "")
        if value:
            os.environ[auth.TLS_ENV[what]] = str(Path(value).resolve())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfabric", description="RL post-training as independent services")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train from a run spec (starts local services unless --coordinator)")
    p.add_argument("config")
    p.add_argument("--run-dir", default="")
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--coordinator", default="", help="submit to a running coordinator instead")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _client_tls(p)
    p = sub.add_parser("resume", help="continue a run from its newest valid checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--coordinator", default="")
    p.add_argument("--quiet", action="store_true")
    _client_tls(p)
    p = sub.add_parser("up", help="start every service locally and keep serving")
    p.add_argument("--runs-root", default="runs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tls", choices=("off", "auto"), default="off",
                   help="auto: a private CA under <runs-root>/.rlfabric/tls (made once), gRPC over mTLS, metrics "
                        "over HTTPS; required for a non-loopback --host unless --insecure-plaintext")
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="serve a non-loopback --host without TLS (the services log a warning)")
    p.add_argument("--allow-import-paths", action="store_true",
                   help="let run specs name code by import path (package.module:attr); anyone holding the token "
                        "can then run any installed code on these services: only where clients are trusted")
    p.add_argument("--dashboard-port", type=int, default=0,
                   help="the coordinator's web dashboard on --host at this port (0: a free one; -1: none); `up` "
                        "prints its one-time login URL, `rlfabric dashboard` a fresh one")
    p = sub.add_parser("certs", help="a private CA and the services' and clients' certificates of a deployment")
    p.add_argument("out_dir")
    p.add_argument("--hosts", required=True, help="every name or address clients and peers dial, comma-separated "
                                                  "(the advertised hosts: --advertise-host or the host name)")
    p.add_argument("--no-loopback", action="store_true", help="leave localhost, 127.0.0.1 and ::1 out")
    p.add_argument("--days", type=int, default=825, help="validity of the services' and clients' certificates")
    p.add_argument("--force", action="store_true", help="replace the CA and certificates already in OUT_DIR")
    p.add_argument("--ca-key-dir", default="", help="write the CA's private key here instead of OUT_DIR: a "
                                                   "directory no service mounts (compose: its own volume)")
    p.add_argument("--if-missing", action="store_true", help="keep the CA and certificates OUT_DIR holds already "
                                                             "(exit 0); make them only where there are none")
    p = sub.add_parser("scrape-token", help="print the metrics scrape token of the deployment's secret")
    p.add_argument("--token-file", default="", help="the deployment's secret (or RLFABRIC_TOKEN_FILE / _TOKEN)")
    p = sub.add_parser("serve", help="run one service (its own flags follow)", add_help=False)
    p.add_argument("service", choices=(*SERVICES, "robot_gateway"))
    p = sub.add_parser("dashboard", help="a fresh one-time login URL of a coordinator's web dashboard")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--token-file", default="", help="the deployment's secret (or RLFABRIC_TOKEN_FILE / _TOKEN)")
    _client_tls(p)
    p = sub.add_parser("status", help="workers and runs of a coordinator")
    p.add_argument("--coordinator", required=True)
    _client_tls(p)
    p = sub.add_parser("stop", help="stop a run")
    p.add_argument("run_id")
    p.add_argument("--coordinator", required=True)
    _client_tls(p)
    p = sub.add_parser("scale", help="add or remove env/rollout workers of a live run (at an epoch boundary)")
    p.add_argument("run_id")
    p.add_argument("role", choices=("rollout", "env"))
    p.add_argument("count", help="+N / -N workers, or N for an absolute count")
    p.add_argument("--coordinator", required=True)
    p.add_argument("--spawn", action="store_true", help="start the added workers as local processes first")
    p.add_argument("--log-dir", default="runs/logs", help="where --spawn writes the new workers' logs")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for workers and the boundary")
    _client_tls(p)
    p = sub.add_parser("plan", help="predict every candidate plan of a spec on a cluster (cluster simulator)")
    p.add_argument("config")
    p.add_argument("--cluster", required=True, help="pools as NAME=UNITS,..., e.g. 'rollout=24,learner=8'")
    p.add_argument("--profile", required=True, help="plan.json (or the run dir) of a scheduling.mode=auto run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=10)
    p = sub.add_parser("eval", help="play episodes with a checkpoint's policy")
    p.add_argument("checkpoint")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="default: the run's own evaluation seed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the run's config, e.g. env.eval_envs=4")
    mode = p.add_mutually_exclusive_group()  # neither: the run's own train.eval_deterministic decides
    mode.add_argument("--stochastic", dest="deterministic", action="store_false", default=None,
                      help="sample the policy's actions (default: as the run's train.eval_deterministic says)")
    mode.add_argument("--deterministic", dest="deterministic", action="store_true", default=None,
                      help="the policy's mode: argmax or mean")
    p = sub.add_parser("collect", help="write an offline data set from a checkpoint's policy, random actions or "
                                       "the env's scripted expert")
    p.add_argument("source", help="a checkpoint (its policy acts), or with --random/--expert a run spec or checkpoint")
    p.add_argument("--out", required=True, help="the .npz data set to write (replay.datasets reads it)")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random", action="store_true", help="uniform random actions instead of the policy")
    p.add_argument("--expert", action="store_true", help="the env's scripted expert (demonstrations to imitate)")
    p.add_argument("--deterministic", action="store_true", help="the policy's mode instead of sampling")
    p.add_argument("--append", action="store_true", help="add to an existing data set (episodes numbered on)")
    p = sub.add_parser("import-lerobot", help="write a LeRobot data set's episodes as demonstrations in a run's env "
                                              "format (an .npz data set)")
    p.add_argument("dataset", help="the LeRobot data set's directory (format v2.x or v3.0: meta/, data/, videos/)")
    p.add_argument("spec", help="the run spec whose env the demonstrations are for")
    p.add_argument("--out", required=True, help="the .npz data set to write (replay.datasets reads it)")
    p.add_argument("--key", action="append", default=[], help="ENV_KEY=FEATURE: which LeRobot feature feeds an "
                                                              "env observation entry (default: matched by name)")
    p.add_argument("--episodes", type=int, default=0, help="import the first N episodes (0: all)")
    p.add_argument("--set", action="append", default=[], help="override a field of the spec (KEY=VALUE)")
    p = sub.add_parser("teleop", help="take over robots on a gateway: keyboard, or the scripted reach expert")
    p.add_argument("--gateway", required=True, help="the robot gateway's HOST:PORT")
    p.add_argument("--robot", default="", help="keyboard teleop of this robot id")
    p.add_argument("--step", type=float, default=0.02, help="rad a joint key moves the target")
    p.add_argument("--expert-goal", default="", help="x,y,z: the scripted expert reaches it on every robot")
    p.add_argument("--start", default="0,-0.3,0.6", help="the robots' start pose (episodes begin there)")
    p.add_argument("--start-tolerance", type=float, default=0.05, help="rad around --start that count as started "
                                                                          "(the env's start_noise + 0.05)")
    p.add_argument("--driver", default="sim", help="whose kinematics the expert uses")
    p.add_argument("--token-file", default="", help="the deployment's secret (or RLFABRIC_TOKEN)")
    _client_tls(p)
    p = sub.add_parser("robot", help="the operator's actions on a robot gateway (clear-estop)")
    robot = p.add_subparsers(dest="robot_command", required=True)
    p = robot.add_parser("clear-estop", help="clear an arm's e-stop and latched faults (the operator only; the "
                                             "arm then holds until a fresh command)")
    p.add_argument("robot_id")
    p.add_argument("--gateway", required=True, help="the robot gateway's HOST:PORT")
    p.add_argument("--operator-token-file", default="", help="the operator's secret, as the gateway's "
                                                             "--operator-token-file [env RLFABRIC_OPERATOR_TOKEN_FILE]")
    p.add_argument("--token-file", default="", help="the deployment's secret (or RLFABRIC_TOKEN)")
    _client_tls(p)
    sub.add_parser("export-lerobot", help="export recorded robot episodes to a LeRobot data set (its flags follow)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] == "serve":
        args, rest = parser.parse_known_args(argv)
        sys.exit(cmd_serve(args, rest))
    if argv and argv[0] == "export-lerobot":
        sys.exit(cmd_export_lerobot(parser.parse_args(argv[:1]), argv[1:]))
    args = parser.parse_args(argv)
    _apply_client_tls(args)
    handlers = {"train": cmd_train, "resume": cmd_resume, "up": cmd_up, "status": cmd_status, "stop": cmd_stop,
                "scale": cmd_scale, "plan": cmd_plan, "eval": cmd_eval, "collect": cmd_collect,
                "import-lerobot": cmd_import_lerobot,
                "teleop": cmd_teleop, "robot": cmd_robot, "certs": cmd_certs, "scrape-token": cmd_scrape_token,
                "dashboard": cmd_dashboard}
    sys.exit(handlers[args.command](args))


if __name__ == "__main__":
    main()
