"""A rank host: learner ranks on a host other than the learner's (``runtime.learner_ranks_per_host``).

``rlfabric serve learner --rank-host-for LEARNER`` runs this instead of a learner: it registers with no
coordinator (the run's learner is its only caller) and serves one RPC, ``HostRanks``, with which that learner
starts ranks here the way torchrun starts them (``python -m rlfabric.services.learner.ranks`` with RANK,
LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE in the environment). They meet their group through the learner's
rendezvous (ranks.Rendezvous: ZeroMQ CURVE), never a TCPStore, and only at the host the operator named
(``--rank-host-for``), so a token holder cannot point this host's ranks elsewhere. A new HostRanks ends the ranks of
the group before (a learner re-configured for a new run or a recovery); each group's ranks exit when the learner
sends its stop, or when their group's collectives fail because the learner went.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import grpc

from rlfabric.services.core import auth
from rlfabric.services.core.proto.rlfabric.v1 import learner_pb2, learner_pb2_grpc
from rlfabric.services.core.runtime import ServiceRuntime
from rlfabric.services.core.weight_transport import check_prefix, local_ip_toward
from rlfabric.services.learner.ranks import PREFIX_ENV, RENDEZVOUS_ENV, socket_interfaces

log = logging.getLogger(__name__)
MAX_WORLD = 64


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""


class RankHost(learner_pb2_grpc.LearnerServicer):
    """Starts and ends one learner's ranks on this host. The other Learner RPCs stay unimplemented here: no
    coordinator places runs on a rank host."""

    def __init__(self, runtime: ServiceRuntime, learner: str):
        self.runtime, self.learner = runtime, learner
        self.procs: list[subprocess.Popen] = []
        runtime.on_shutdown(self.close)

    def check(self, request: learner_pb2.HostRanksRequest) -> str:
        """The request's fields, checked (a ValueError naming the field); the rendezvous host's address."""
        if not 2 <= request.world <= MAX_WORLD:
            raise ValueError(f"world={request.world}: a group spanning hosts has 2..{MAX_WORLD} ranks")
        if not (1 <= request.first_rank and 1 <= request.count and request.first_rank + request.count <= request.world):
            raise ValueError(f"first_rank={request.first_rank}, count={request.count}: ranks outside 1..world-1 "
                             f"(world {request.world}; rank 0 is the learner)")
        check_prefix(request.prefix)
        if request.device not in ("cpu", "cuda"):
            raise ValueError(f"device={request.device[:20]!r}: cpu or cuda")
        if not 0 < request.timeout_s <= 86400:
            raise ValueError(f"timeout_s={request.timeout_s}: (0, 86400] seconds")
        endpoint = request.rendezvous
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not endpoint.startswith("tcp://") or not port.isdigit() or not host:
            raise ValueError(f"rendezvous={endpoint[:80]!r}: tcp://HOST:PORT of the learner's rank rendezvous")
        ip = _resolve(host.strip("[]"))
        if not ip or ip != _resolve(self.learner):
            raise ValueError(f"rendezvous host {host!r} is not this rank host's learner ({self.learner!r}, as "
                             f"--rank-host-for names it): a rank host's ranks meet that learner only")
        return ip

    async def HostRanks(self, request, context):
        try:
            learner_ip = self.check(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"HostRanks: {exc}")
        if request.device == "cuda":
            import torch  # only a CUDA rank host needs to count its devices

            if torch.cuda.device_count() < request.count:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"HostRanks: {request.count} CUDA ranks, but this host has "
                                    f"{torch.cuda.device_count()} GPUs. Fix: runtime.learner_ranks_per_host")
        self.end_ranks()
        ip = local_ip_toward(learner_ip)  # this host's address on the learner's network: where its ranks listen
        env = {**os.environ, **socket_interfaces(ip), "WORLD_SIZE": str(request.world),
               "LOCAL_WORLD_SIZE": str(request.count), "RLFABRIC_LEARNER_DEVICE": request.device,
               "RLFABRIC_LEARNER_TIMEOUT_S": str(request.timeout_s), RENDEZVOUS_ENV: request.rendezvous,
               PREFIX_ENV: request.prefix, "RLFABRIC_TOKEN": auth.current().token}
        env.pop("RLFABRIC_TOKEN_FILE", None)  # the token itself (never argv): the file may be this process's only
        for local in range(request.count):
            rank = request.first_rank + local
            self.procs.append(subprocess.Popen([sys.executable, "-m", "rlfabric.services.learner.ranks"],
                                               env={**env, "RANK": str(rank), "LOCAL_RANK": str(local)},
                                               stdin=subprocess.DEVNULL))
        log.info("learner ranks started", extra={"ranks": f"{request.first_rank}..{request.first_rank + request.count - 1}",
                                                 "world": request.world, "listen": ip,
                                                 "pids": [p.pid for p in self.procs]})
        return learner_pb2.HostRanksReply(pids=[p.pid for p in self.procs], host=ip)

    def end_ranks(self) -> None:
        """End the ranks of the group before (they have finished when their learner sent stop)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.returncode not in (0, -9):
                log.warning("a learner rank exited with an error", extra={"pid": proc.pid, "code": proc.returncode})
        self.procs = []

    def close(self) -> None:
        self.end_ranks()


async def build(runtime: ServiceRuntime, learner: str) -> None:
    if not learner:
        raise SystemExit("serve learner --rank-host-for needs the learner's host name or address")
    runtime.options.coordinator = ""  # a rank host takes no runs: the learner that names it calls it directly
    learner_pb2_grpc.add_LearnerServicer_to_server(RankHost(runtime, learner), runtime.server)
