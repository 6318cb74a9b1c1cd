"""The learner as N torch.distributed ranks (``runtime.learner_ranks``): FSDP2 data parallelism.

The learner service is rank 0. It starts ranks 1..N-1 itself, the way torchrun would (``python -m
rlfabric.services.learner.ranks`` with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK in the environment), and
drives them as a single controller: each call it makes (configure, update, gather the weights) is broadcast to
every rank as a command, and all ranks then run the same collective code. Gloo on CPU, NCCL on CUDA: the same code.

    configure   every rank builds the policy from the same seed; rank 0's weights (a warm start or a resume) are
                broadcast; the policy is sharded with ``fully_shard`` (each decoder layer, then the root); every
                rank builds the algorithm
    update      rank 0's batch (codec frames: a typed header plus raw buffers, never pickle) is broadcast; each
                rank computes its share of every minibatch's loss (``Algorithm.shard``, denominators of the whole
                minibatch) and FSDP sums the gradients (divide factor 1), so N ranks make the update one rank would
    gather      the full weights (or optimiser state) on rank 0, for publishing and checkpoints

A rank that dies makes the next collective fail on rank 0 within ``data_plane.timeout_s`` (not hang), and the
learner's health check names it.

torch.distributed authenticates nobody, so the group is kept out of reach instead: rank 0 binds the store to
loopback itself (torch would bind all interfaces), gloo listens on the loopback interface, and the group's keys live
under a random prefix that reaches ranks 1..N-1 in their environment (never argv, which ``ps`` shows).

Across hosts (``runtime.learner_ranks_per_host`` G < N): ranks 1..G-1 start here as above, and each further G on a
rank host the learner's operator named (``serve learner --rank-hosts``; rank_host.py), which the learner asks over
gRPC (token, TLS) to start them. Those ranks do not dial a TCPStore, which anyone who reaches it may list and write:
their rendezvous keys go through ``Rendezvous``, a data-plane server of rank 0 (ZeroMQ CURVE, keys derived from the
deployment's secret) that reaches the loopback store only under the group's random prefix, the way weight pairs
meet (weight_transport.ChannelStore). The prefix travels only in that gRPC call. Every rank's gloo device then
listens on its host's routable interface, and accepts only the peers whose addresses came through those keys.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfabric.services.core.codec import decode, encode, pack_frames, unpack_frames
from rlfabric.services.core.policy import ForwardMethods, OwnCritic, ShardUnits
from rlfabric.services.core.weight_transport import (
    ChannelStore,
    asking,
    bind_address,
    check_prefix,
    confined_store_op,
    interface_of,
    listening_store,
    new_prefix,
    store_message,
    store_value,
)

log = logging.getLogger(__name__)
CONFIGURE, UPDATE, WEIGHTS, OPTIMIZER, STOP = range(5)
MAX_COMMAND_BYTES = 1 << 31
LOOPBACK = "127.0.0.1"  # the store's address: ranks on the learner's host dial it directly
PREFIX_ENV = "RLFABRIC_LEARNER_STORE_PREFIX"
RENDEZVOUS_ENV = "RLFABRIC_LEARNER_RENDEZVOUS"  # a rank on another host: rank 0's Rendezvous endpoint
MAX_GROUP_KEYS = 4096
RENDEZVOUS_BYTES = 1 << 20


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or CUDA device r of this host."""
    return base if base.type == "cpu" else torch.device("cuda", rank)


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


# -- what every rank runs -----------------------------------------------------------------------------------------
_wire = torch.device("cpu")  # where command tensors live: the CPU for gloo, this rank's GPU for NCCL


def _send(op: int, payload: bytes = b"") -> None:
    dist.broadcast(torch.tensor([op, len(payload)], dtype=torch.int64, device=_wire), src=0)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_wire), src=0)


def _receive() -> tuple[int, bytes]:
    head = torch.zeros(2, dtype=torch.int64, device=_wire)
    dist.broadcast(head, src=0)
    op, n = int(head[0]), int(head[1])
    if not 0 <= n <= MAX_COMMAND_BYTES:
        raise ValueError(f"a learner command of {n} bytes: the rank group is out of step")
    data = torch.empty(n, dtype=torch.uint8, device=_wire)
    if n:
        dist.broadcast(data, src=0)
    return op, data.cpu().numpy().tobytes()


def _init(device: torch.device, rank: int, world: int, timeout_s: float, store: dist.Store, prefix: str) -> None:
    global _wire
    _wire = device
    dist.init_process_group(backend_for(device), store=dist.PrefixStore(f"rlfabric/learner/{check_prefix(prefix)}",
                                                                        store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def socket_interfaces(ip: str) -> dict[str, str]:
    """Environment that makes gloo (and NCCL, unless the operator chose) listen on the interface holding ``ip``
    (loopback when every rank is on this host): gloo otherwise listens on whatever this host's name resolves to."""
    name = interface_of(ip)
    if name is None:
        return {}
    env = {"GLOO_SOCKET_IFNAME": name}
    if "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = f"={name}"
    return env


def shard_policy(policy: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2 over every rank: each of the policy's shard units (an LM's decoder layers) is one all-gather group,
    the root holds the rest. Gradients are summed, not averaged: each rank's loss is its share of the minibatch's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in policy.shard_units() if isinstance(policy, ShardUnits) else []:
        fully_shard(unit, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    if isinstance(policy, ForwardMethods):  # entry points besides forward() gather weights too
        for method in policy.forward_methods:
            register_fsdp_forward_method(policy, method)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return policy


def load_starting_weights(policy: torch.nn.Module, weights: dict, warm: bool) -> None:
    """``weights`` into ``policy``, exactly. A warm start (a supervised run's weights) may differ in the critic's own
    weights alone (the policy's ``value_modules``): supervised training never trains them, so an RL run may pick
    another critic (``critic: own``), which then starts fresh. Any other difference raises."""
    try:
        policy.load_state_dict(weights)
        return
    except RuntimeError:
        critic = tuple(f"{m}." for m in policy.value_modules) if isinstance(policy, OwnCritic) else ()
        if not warm or not critic:
            raise
    ours = policy.state_dict()
    actor = {k: v for k, v in weights.items() if not k.startswith(critic)}
    if set(actor) == {k for k in ours if not k.startswith(critic)}:
        policy.load_state_dict({**actor, **{k: v for k, v in ours.items() if k.startswith(critic)}})
        log.info("policy.init_checkpoint: the actor's weights loaded; the critic starts fresh (the checkpoint's "
                 "has another shape)")
        return
    policy.load_state_dict(weights)  # raises, naming the keys that differ


def initial_policy(config: Any, env_spec: dict, device: torch.device, weights: dict | None) -> torch.nn.Module:
    """The run's policy on ``device``, built from the run's seed, holding ``weights`` (a warm start's or a
    checkpoint's) when given: what a learner of any number of ranks starts from."""
    from rlfabric.services.core.models import build_policy

    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    policy = build_policy(config.policy_name, env_spec, config.policy).to(device)
    if weights is not None:
        try:
            load_starting_weights(policy, weights, warm=bool(config.policy.init_checkpoint))
        except RuntimeError as exc:
            raise ValueError(f"the starting weights (policy.init_checkpoint={config.policy.init_checkpoint!r}, or "
                             f"the run's checkpoint) hold another policy shape: {str(exc)[:300]}. Fix: give the same "
                             f"policy section as that run") from None
    return policy


def build(config: Any, env_spec: dict, device: torch.device, policy_state: dict | None) -> tuple[Any, Any, Any]:
    """(policy, algorithm, generator) of this rank, built collectively: same seed, rank 0's weights broadcast
    before sharding (so a frozen reference copy starts from them too)."""
    spec = config.spec
    policy = initial_policy(config, env_spec, device, policy_state)
    with torch.no_grad():
        for tensor in policy.state_dict().values():
            dist.broadcast(tensor, src=0)
    roles = {}
    if spec.needs(config.algorithm).reference:
        roles["reference"] = copy.deepcopy(policy).eval().requires_grad_(False)
    shard_policy(policy, device)
    generator = torch.Generator(device=device).manual_seed(config.seed + 7)
    algo = spec(policy, config, generator, env_spec=env_spec, **roles)
    algo.rank, algo.world = dist.get_rank(), dist.get_world_size()
    return policy, algo, generator


def full_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights, on rank 0's CPU (other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer(policy: torch.nn.Module, optimizer: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))


def load_optimizer(policy: torch.nn.Module, optimizer: Any, state: dict) -> None:
    """Rank 0's full optimiser state (a checkpoint's), scattered to every rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(policy, optimizer, state, options=StateDictOptions(full_state_dict=True,
                                                                                broadcast_from_rank0=True))


def _sync_generator(generator: torch.Generator) -> None:
    """Every rank draws the same minibatch order from its generator."""
    state = generator.get_state().to(_wire)
    dist.broadcast(state, src=0)
    generator.set_state(state.cpu())


def worker_main() -> None:
    """Ranks 1..N-1: execute rank 0's commands until it says stop (or its process group fails)."""
    from rlfabric.services.core.config import RunConfig
    from rlfabric.services.core.runtime import learner_precision, set_torch_threads

    logging.basicConfig(level=logging.INFO, format=f"learner rank {os.environ.get('RANK')}: %(message)s")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = torch.device(os.environ.get("RLFABRIC_LEARNER_DEVICE", "cpu"))
    device = rank_device(base, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout_s = float(os.environ.get("RLFABRIC_LEARNER_TIMEOUT_S", "600"))
    if os.environ.get(RENDEZVOUS_ENV):  # a rank on another host than the learner's
        store = rendezvous_store(os.environ[RENDEZVOUS_ENV], timeout_s)
    else:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              timedelta(seconds=timeout_s))
    _init(device, rank, world, timeout_s, store, os.environ.get(PREFIX_ENV, ""))
    policy = algo = None
    try:
        while True:
            op, payload = _receive()
            if op == CONFIGURE:
                info = json.loads(payload)
                config = RunConfig.from_json(info["config_json"])
                set_torch_threads(config.runtime.torch_threads)
                policy, algo, generator = build(config, info["env_spec"], device, None)
                if info["resume"]:
                    load_optimizer(policy, algo.optimizer, {})
                _sync_generator(generator)
            elif op == UPDATE:
                _, batch = decode(unpack_frames(payload), max_bytes=MAX_COMMAND_BYTES)
                with learner_precision(config.runtime.precision, device):
                    algo.update(batch.to_torch(device))
            elif op == WEIGHTS:
                full_weights(policy)
            elif op == OPTIMIZER:
                full_optimizer(policy, algo.optimizer)
            elif op == STOP:
                break
            else:
                raise ValueError(f"unknown learner command {op}")
    finally:
        dist.destroy_process_group()


def rendezvous_store(endpoint: str, timeout_s: float) -> ChannelStore:
    """A rank on another host: the group's keys through rank 0's ``Rendezvous`` (CURVE with the deployment's
    secret, which reaches this process in its environment as it reaches every service)."""
    from rlfabric.services.core import auth
    from rlfabric.services.core.dataplane import DataClient

    auth.configure(auth.token_from_environment())
    client = DataClient(endpoint, max_bytes=RENDEZVOUS_BYTES, timeout_s=min(timeout_s, 60.0),
                        peer="the learner's rank rendezvous")
    return ChannelStore(asking(client), timeout_s, owner="learner ranks: the learner")


class Rendezvous:
    """Rank 0's side of a group that spans hosts: a data-plane server (CURVE) on the learner's address whose only
    request is a store operation under the group's prefix, done on the loopback store rank 0 listens with."""

    def __init__(self, store_port: int, prefix: str, host: str, advertise_host: str, timeout_s: float):
        from rlfabric.services.core.dataplane import DataServer

        self.store_port, self.timeout_s = store_port, timeout_s
        self.root = f"rlfabric/learner/{prefix}/"
        self.keys = 0
        self._client: dist.Store | None = None  # made and used on the server's thread only
        self.server = DataServer(host, max_bytes=RENDEZVOUS_BYTES, name="learner-ranks", advertise_host=advertise_host)
        self.endpoint = self.server.endpoint
        self.server.start(self._handle)

    def _handle(self, kind: str, batch: Any, reply: Any) -> None:
        if kind != "store":
            raise ValueError(f"unknown request kind {kind!r}; a learner's rank rendezvous answers store only")
        if self._client is None:
            self._client = dist.TCPStore(LOOPBACK, self.store_port, None, False, timedelta(seconds=self.timeout_s))
        answer, out = confined_store_op(self._client, batch.meta, store_value(batch), self.root, self._new_key,
                                        "learner ranks")
        reply.send("stored", store_message(answer, out))

    def _new_key(self) -> None:
        self.keys += 1
        if self.keys > MAX_GROUP_KEYS:
            raise ValueError(f"learner ranks: a group's rendezvous holds at most {MAX_GROUP_KEYS} keys")

    def health(self) -> str | None:
        return self.server.health()

    def close(self) -> None:
        self.server.stop()


class RankGroupFailed(RuntimeError):
    """A collective of a learner whose ranks span hosts failed: a link to a rank host, or a rank there, went."""


class RankHostError(RuntimeError):
    """A rank host the run needs did not start its ranks (unreachable, not started, refused the request)."""


def host_ranks(address: str, request: Any, timeout_s: float) -> Any:
    """Ask the rank host at ``address`` to start its ranks (HostRanks over the control plane: token, TLS). A rank
    host not reachable yet is waited for up to ``timeout_s`` (a link coming back, a pod starting): a run recovering
    from a cut link re-forms its group once the link returns."""
    import grpc

    from rlfabric.services.core import auth
    from rlfabric.services.core.proto.rlfabric.v1 import learner_pb2_grpc
    from rlfabric.services.core.runtime import GRPC_OPTIONS

    with auth.sync_channel(address, GRPC_OPTIONS) as channel:
        try:
            return learner_pb2_grpc.LearnerStub(channel).HostRanks(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise RankHostError(f"learner ranks: the rank host {address} did not start ranks {request.first_rank}.."
                               f"{request.first_rank + request.count - 1}: {exc.code().name}: {exc.details()}. "
                               f"Fix: start it (`rlfabric serve learner --rank-host-for LEARNER_HOST`) and check "
                               f"that the learner reaches it") from None


# -- rank 0: the learner service's side ----------------------------------------------------------------------------
class RankGroup:
    """Ranks 1..N-1 of one run, started and driven by the learner service (rank 0, on its training thread)."""

    def __init__(self, world: int, device: torch.device, timeout_s: float, *, per_host: int = 0,
                 rank_hosts: tuple[str, ...] = (), host: str = LOOPBACK, advertise_host: str = ""):
        self.world, self.device = world, device
        local = per_host if 0 < per_host < world else world
        needed = world // local - 1  # rank hosts besides this one
        if needed > len(rank_hosts):
            raise ValueError(f"runtime.learner_ranks={world} with learner_ranks_per_host={local} needs {needed} rank "
                             f"host(s) besides the learner's, and this learner was given {len(rank_hosts)} "
                             f"(serve learner --rank-hosts). Fix: start `rlfabric serve learner --rank-host-for "
                             f"{advertise_host or host}` on {needed} other host(s) and list their addresses in this "
                             f"learner's --rank-hosts (RLFABRIC_RANK_HOSTS), or runtime.learner_ranks_per_host: 0")
        self.store = listening_store(LOOPBACK, timeout_s)
        prefix = new_prefix()
        # across hosts, every rank's gloo device listens where the others can reach it: the learner's own address
        interfaces = socket_interfaces(bind_address(host, advertise_host) if needed else LOOPBACK)
        if "GLOO_SOCKET_IFNAME" in interfaces:  # this process is rank 0: its gloo device listens there too
            os.environ["GLOO_SOCKET_IFNAME"] = interfaces["GLOO_SOCKET_IFNAME"]
        env = {**os.environ, **interfaces, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(self.store.port),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "RLFABRIC_LEARNER_DEVICE": device.type,
               "RLFABRIC_LEARNER_TIMEOUT_S": str(timeout_s), PREFIX_ENV: prefix}
        self.procs = [subprocess.Popen([sys.executable, "-m", "rlfabric.services.learner.ranks"],
                                       env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL)
                      for r in range(1, local)]
        self.rendezvous: Rendezvous | None = None
        self.remote: list[str] = []  # what errors name: each rank host, its ranks and where they listen
        self.remote_pids: list[int] = []  # their processes there, in rank order
        self.failed: str | None = None  # why a collective across hosts failed: the group is out of step for good
        try:
            if needed:
                from rlfabric.services.core.proto.rlfabric.v1 import learner_pb2

                self.rendezvous = Rendezvous(self.store.port, prefix, host, advertise_host, timeout_s)
                for h, address in enumerate(rank_hosts[:needed], start=1):
                    first = h * local
                    reply = host_ranks(address, learner_pb2.HostRanksRequest(
                        world=world, first_rank=first, count=local, rendezvous=self.rendezvous.endpoint,
                        prefix=prefix, device=device.type, timeout_s=timeout_s), timeout_s=min(timeout_s, 60.0))
                    self.remote.append(f"ranks {first}..{first + local - 1} on {address} ({reply.host})")
                    self.remote_pids += list(reply.pids)
            _init(device, 0, world, timeout_s, self.store, prefix)
        except Exception:
            self._kill()
            self._close_rendezvous()
            self.store = None
            raise
        log.info("learner ranks up", extra={"world": world, "backend": backend_for(device),
                                            "other_hosts": "; ".join(self.remote)})

    @contextmanager
    def _collective(self):
        """A failed collective of a group that spans hosts names them: a link to one of them, or a rank there,
        went."""
        try:
            yield
        except RuntimeError as exc:
            if not self.remote:
                raise
            self.failed = (f"{exc} [the learner's ranks on other hosts: {'; '.join(self.remote)}: a link to one of "
                           f"them or a rank there went]")
            raise RankGroupFailed(self.failed) from exc

    def dead(self) -> str | None:
        """Why the group cannot work (a rank process that exited, a failed collective across hosts), or None."""
        if self.failed:
            return self.failed
        for r, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                return f"learner rank {r} (pid {proc.pid}) exited with code {proc.returncode}"
        return self.rendezvous.health() if self.rendezvous is not None else None

    def configure(self, config: Any, env_spec: dict, policy_state: dict | None,
                  resume: dict | None) -> tuple[Any, Any, Any]:
        """Every rank builds; ``policy_state`` (a warm start or the resumed policy) and ``resume``'s optimiser state
        and generator reach every rank. The weights' broadcast is a collective across hosts too: a link that fails
        it (one just back from a cut, say) fails it as RankGroupFailed, which the coordinator recovers from."""
        with self._collective():
            _send(CONFIGURE, json.dumps({"config_json": config.to_json(), "env_spec": env_spec,
                                         "resume": resume is not None}).encode())
            policy, algo, generator = build(config, env_spec, self.device, policy_state)
            if resume is not None:
                load_optimizer(policy, algo.optimizer, resume["algorithm"]["optimizer"])
                algo.env_steps = int(resume["algorithm"].get("env_steps", 0))
                algo.optimizer_steps = int(resume["algorithm"]["optimizer_steps"])
                generator.set_state(resume["generator"])
            _sync_generator(generator)
        return policy, algo, generator

    def update(self, algo: Any, batch: Any) -> dict[str, float]:
        with self._collective():
            _send(UPDATE, pack_frames(encode("batch", batch)))
            return algo.update(batch.to_torch(self.device))

    def weights(self, policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        with self._collective():
            _send(WEIGHTS)
            return full_weights(policy)

    def algorithm_state(self, policy: torch.nn.Module, algo: Any) -> dict:
        """The algorithm's checkpoint state with its optimiser state unsharded (keyed by parameter name)."""
        with self._collective():
            _send(OPTIMIZER)
            return {"optimizer": full_optimizer(policy, algo.optimizer), "env_steps": algo.env_steps,
                    "optimizer_steps": algo.optimizer_steps}

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    def _close_rendezvous(self) -> None:
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None

    def close(self) -> None:
        try:
            if self.dead() is None:
                _send(STOP)
        except RuntimeError as exc:  # a broken group: the ranks are killed below anyway
            log.warning("learner ranks did not stop cleanly", extra={"error": str(exc)})
        finally:
            for proc in self.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            self._close_rendezvous()
            self.store = None  # its listening socket closes with the last reference


if __name__ == "__main__":
    worker_main()
