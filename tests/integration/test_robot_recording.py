"""Episode recording through a real gateway process (sim arm): a policy drives, a human takes over in the middle and
hands back, the episode ends with SUCCESS and is found in the gateway's object store with every tick and exactly the
loop's intervened ticks, and in replay (a stand-in data-plane server with replay's stores) as a source plus an
interventions-only source; the next episode, re-recorded, is found nowhere. Bad requests are refused naming the field."""

from __future__ import annotations

import os
import queue
import threading
import time

import grpc
import numpy as np
import pytest

pytest.importorskip("mujoco")

from rlfabric.services.core import auth  # noqa: E402
from rlfabric.services.core.batch import TensorBatch  # noqa: E402
from rlfabric.services.core.dataplane import DataServer  # noqa: E402
from rlfabric.services.core.objectstore import FilesystemObjectStore  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb  # noqa: E402
from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2_grpc  # noqa: E402
from rlfabric.services.core.runtime import GRPC_OPTIONS  # noqa: E402
from rlfabric.services.replay.stores.memory import MemoryStore  # noqa: E402
from rlfabric.services.robot_gateway.recording import read_episodes  # noqa: E402
from tests.robot_support import gateway_process  # noqa: E402

pytestmark = pytest.mark.serial  # a 100 Hz deadline loop: timed, so never beside another test

TOKEN = "robot-recording-test-token"
START = [0.0, -0.3, 0.6]
KINDS = pb.TeleopEvent.Kind


class FakeReplay:
    """Replay's data-plane put, in this process, over replay's own stores (CURVE with the gateway's token)."""

    def __init__(self):
        auth.configure(TOKEN)
        self.stores = {"robot": MemoryStore(100_000), "robot_interventions": MemoryStore(100_000)}
        self.server = DataServer(max_bytes=1 << 26, name="fake-replay")
        self.server.start(self.handle)

    def handle(self, kind: str, batch: TensorBatch, reply) -> None:
        store = self.stores[batch.meta["source"]]
        store.put(batch)
        reply.send("ack", TensorBatch(meta={"transitions": store.transitions}))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One scripted session: episode e (policy, then a human, then the policy: SUCCESS), episode e+1 (RERECORD)."""
    root = tmp_path_factory.mktemp("store")
    old = os.environ.get("RLFABRIC_STORAGE_ROOT")
    os.environ["RLFABRIC_STORAGE_ROOT"] = str(root)
    replay = FakeReplay()
    try:
        with gateway_process(tmp_path_factory.mktemp("gw"), TOKEN, "--replay-endpoints",
                             replay.server.endpoint) as address:
            channel = auth.sync_channel(address, GRPC_OPTIONS, auth.Security(TOKEN))
            stub = robot_gateway_pb2_grpc.RobotGatewayStub(channel)
            stub.Connect(pb.ConnectRequest(robot_id="arm", driver="sim", options={"start": "0,-0.3,0.6"},
                                           control_hz=100, watchdog_s=0.1), timeout=30)
            started = stub.StartRecording(pb.RecordingRequest(
                robot_id="arm", dataset="demo", task="hold the arm still", replay_endpoint=replay.server.endpoint,
                replay_source="robot", intervention_source="robot_interventions"), timeout=30)
            states = script(stub)
            stopped = stub.StopRecording(pb.RobotRef(robot_id="arm"), timeout=30)
            yield {"stub": stub, "root": root, "replay": replay, "states": states, "started": started,
                   "stopped": stopped}
            channel.close()
    finally:
        replay.server.stop()
        if old is None:
            os.environ.pop("RLFABRIC_STORAGE_ROOT", None)
        else:
            os.environ["RLFABRIC_STORAGE_ROOT"] = old


def script(stub) -> list:
    """The policy holds the start pose; states 30-60 the human commands a small yaw; SUCCESS at 70; the next
    episode is re-recorded after 20 states; 10 states into the one after, the script stops."""
    events: queue.Queue = queue.Queue()
    stop = threading.Event()

    def policy():
        seq = 0
        while not stop.is_set():
            seq += 1
            yield pb.JointCommand(robot_id="arm", seq=seq, position=START)
            time.sleep(0.01)

    def human():
        while (event := events.get()) is not None:
            yield event

    teleop = stub.Teleop(human(), timeout=30)

    def drain() -> None:  # the teleop stream's states: not needed
        try:
            for _ in teleop:
                pass
        except grpc.RpcError as exc:  # cancelled at the end of the script
            assert exc.code() == grpc.StatusCode.CANCELLED

    threading.Thread(target=drain, daemon=True).start()
    seen, first_episode, marks = [], None, {}
    for state in stub.Control(policy(), timeout=30):
        seen.append(state)
        n = len(seen)
        if first_episode is None:
            first_episode = state.episode
        if n == 30:
            events.put(pb.TeleopEvent(robot_id="arm", kind=KINDS.INTERVENE_START, command=pb.JointCommand(
                robot_id="arm", seq=10_000, position=[0.05, -0.3, 0.6])))
        elif 30 < n < 60:
            events.put(pb.TeleopEvent(robot_id="arm", kind=KINDS.COMMAND, command=pb.JointCommand(
                robot_id="arm", seq=10_000 + n, position=[0.05, -0.3, 0.6])))
        elif n == 60:
            events.put(pb.TeleopEvent(robot_id="arm", kind=KINDS.INTERVENE_STOP))
        elif n == 70:
            events.put(pb.TeleopEvent(robot_id="arm", kind=KINDS.SUCCESS))
        if state.episode == first_episode + 1:
            marks.setdefault("second", n)
            if n - marks["second"] == 20:
                events.put(pb.TeleopEvent(robot_id="arm", kind=KINDS.RERECORD))
        if state.episode == first_episode + 2:
            marks.setdefault("third", n)
            if n - marks["third"] == 10:
                break
        assert n < 1000, "the script's episodes never ended"
    stop.set()
    events.put(None)
    teleop.cancel()
    return seen


def test_a_success_with_an_intervention_lands_in_the_object_store_with_every_tick(recorded):
    states, root = recorded["states"], recorded["root"]
    first = states[0].episode
    assert recorded["started"].recording and recorded["started"].dataset == "demo"
    stopped = recorded["stopped"]
    assert not stopped.recording and stopped.episodes_kept == 1 and stopped.episodes_discarded == 1
    assert stopped.ticks_dropped == 0 and stopped.write_errors == 0, stopped.last_error
    episodes = read_episodes(FilesystemObjectStore(root), f"recordings/demo/arm/{stopped.session}/")
    assert len(episodes) == 1, [m["episode"] for m, _ in episodes]
    meta, cols = episodes[0]
    assert meta["outcome"] == "success" and meta["episode"] == first and meta["task"] == "hold the arm still"
    assert meta["joint_names"] == ["yaw", "shoulder", "elbow"] and meta["control_hz"] == 100
    assert stopped.last_episode_uri.endswith(f"episode_{first:06d}.npz")
    ticks = cols["tick"]
    assert np.array_equal(ticks, np.arange(ticks[0], ticks[0] + len(ticks)))  # every tick, none dropped
    episode_states = [s for s in states if s.episode == first]
    # (a state stream drops its oldest states for a reader that lags, so compare on the ticks it did deliver)
    assert ticks[-1] >= episode_states[-1].seq and ticks[0] <= episode_states[0].seq
    # the human's ticks, exactly: the loop's own count (final 10 states before the verdict), and the stream's flags
    intervened = {int(t) for t in ticks[cols["intervened"]]}
    assert meta["intervened_ticks"] == len(intervened) == episode_states[-1].episode_intervened_ticks > 20
    assert intervened & {s.seq for s in episode_states} == {s.seq for s in episode_states if s.intervening}
    by_tick = {s.seq: s for s in episode_states}
    for i, t in enumerate(ticks):
        if int(t) in by_tick:  # what the gateway recorded is what it published that tick
            s = by_tick[int(t)]
            assert np.allclose(cols["actions"][i], s.target, atol=1e-6)
            assert np.allclose(cols["obs/position"][i], s.position, atol=1e-6)
            assert cols["command_seq"][i] == s.command_seq and cols["holding"][i] == s.holding
    assert cols["command_seq"][cols["intervened"]].min() >= 10_000  # the human's commands drove those ticks
    assert cols["rewards"].tolist()[-1] == 1.0 and cols["terminated"][-1] and cols["rewards"][:-1].sum() == 0


def test_the_episode_reaches_replay_and_its_interventions_their_own_source(recorded):
    stores = recorded["replay"].stores
    states = recorded["states"]
    last = [s for s in states if s.episode == states[0].episode][-1]
    assert stores["robot_interventions"].transitions == last.episode_intervened_ticks
    rows = stores["robot_interventions"].sample(16, np.random.default_rng(0))
    assert rows["intervened"].all() and (rows["command_seq"] >= 10_000).all()
    assert stores["robot"].transitions > last.episode_intervened_ticks and recorded["stopped"].replay_pushes == 2


def test_a_rerecorded_episode_is_discarded(recorded):
    first = recorded["states"][0].episode
    root = recorded["root"]
    keys = FilesystemObjectStore(root).list("recordings/")
    assert not [k for k in keys if f"episode_{first + 1:06d}" in k], keys
    assert len(recorded["replay"].stores["robot"]) == 1  # the episode that was kept, only
    assert recorded["stopped"].episodes_discarded == 1


def test_recording_requests_are_checked(recorded):
    stub = recorded["stub"]

    def refused(request) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as err:
            stub.StartRecording(request, timeout=10)
        return err.value

    err = refused(pb.RecordingRequest(robot_id="arm", dataset="../etc"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "dataset=" in err.details()
    err = refused(pb.RecordingRequest(robot_id="arm", dataset="d", replay_endpoint="tcp://127.0.0.1:1"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "replay_source" in err.details()
    err = refused(pb.RecordingRequest(robot_id="nobody", dataset="d"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    started = stub.StartRecording(pb.RecordingRequest(robot_id="arm", dataset="again"), timeout=10)
    assert stub.StartRecording(pb.RecordingRequest(robot_id="arm", dataset="again"), timeout=10).session \
        == started.session  # a retried call is the same recording
    err = refused(pb.RecordingRequest(robot_id="arm", dataset="other"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "StopRecording" in err.details()
    assert stub.GetRecording(pb.RobotRef(robot_id="arm"), timeout=10).recording
    last = stub.Disconnect(pb.RobotRef(robot_id="arm"), timeout=30)  # a disconnect ends the recording too
    assert last.robot_id == "arm"
