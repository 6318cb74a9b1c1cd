"""Recorded episodes to LeRobot's format through LeRobot's own library, and back through its loader: the episodes,
frames, states, actions and intervention flags survive. lerobot is an optional extra (0.4.x needs torch < 2.11 and
torchvision, which this project's torch 2.13 CPU environment does not carry), so the round trip skips without it;
the frame layout and the CLI's errors are checked either way."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from rlfabric.services.core.objectstore import FilesystemObjectStore
from rlfabric.services.robot_gateway.export import features, frames, main
from rlfabric.services.robot_gateway.loop import Tick
from rlfabric.services.robot_gateway.recording import ObjectStoreSink, Recorder, read_episodes

JOINTS = ["yaw", "shoulder", "elbow"]
HAS_LEROBOT = importlib.util.find_spec("lerobot") is not None


def record(root) -> FilesystemObjectStore:
    """Two kept episodes (a success with 3 intervened ticks of 8, a failure of 5) and a re-recorded one."""
    store = FilesystemObjectStore(root)
    rec = Recorder("arm", JOINTS, 50.0, [ObjectStoreSink(store, "recordings/demo/arm/s1")], task="reach").start()
    k = 0
    for episode, (n, verdict) in enumerate([(8, "success"), (4, "rerecord"), (5, "failure")]):
        for i in range(n):
            q = np.array([0.01 * k, -0.3, 0.6])
            rec.offer(Tick(k, 0.02 * k, q, np.zeros(3), q + 0.002, False, "", False, "", 0.0, 0.0, 0, k,
                           intervening=episode == 0 and 2 <= i < 5, episode=episode,
                           end_effector=np.array([0.5, 0.0, 0.3])))
            k += 1
        rec.episode_ended(episode, verdict)
    rec.offer(Tick(k, 0.02 * k, np.zeros(3), np.zeros(3), np.zeros(3), False, "", False, "", 0.0, 0.0, 0, k,
                   episode=3))
    rec.stop()
    return store


def test_frames_match_the_feature_specs(tmp_path):
    store = record(tmp_path / "store")
    (meta, cols), _ = read_episodes(store, "recordings/")
    specs = features(meta["joint_names"])
    out = list(frames(meta, cols))
    assert len(out) == 8 and out[0]["task"] == "reach"
    for frame in out:
        for name, spec in specs.items():
            value = frame[name]
            assert value.dtype == np.dtype(spec["dtype"]) and value.shape == spec["shape"], name
    assert [bool(f["intervened"][0]) for f in out] == [False, False, True, True, True, False, False, False]
    assert out[-1]["next.success"][0] and out[-1]["next.reward"][0] == 1.0 and not out[0]["next.done"][0]


def test_the_cli_names_what_is_wrong(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--store-root", str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--repo-id", "me/x"])
    assert "--store-root" in capsys.readouterr().err
    record(tmp_path / "store")
    code = main(["--store-root", str(tmp_path / "store"), "--prefix", "recordings/nothing/", "--out",
                 str(tmp_path / "o"), "--repo-id", "me/x"])
    err = capsys.readouterr().err
    assert code == 2 and ("no recorded episode" in err or "lerobot" in err)


@pytest.mark.skipif(not HAS_LEROBOT, reason="lerobot is not installed: it is an optional extra (lerobot 0.4.x "
                                            "requires torch<2.11 and torchvision; this environment pins torch 2.13 "
                                            "CPU without torchvision)")
def test_export_round_trip_through_lerobot(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    record(tmp_path / "store")
    out = tmp_path / "lerobot"
    assert main(["--store-root", str(tmp_path / "store"), "--out", str(out), "--repo-id", "local/arm_demo"]) == 0
    ds = LeRobotDataset("local/arm_demo", root=out)
    assert ds.num_episodes == 2 and ds.num_frames == 13 and ds.fps == 50
    assert ds.meta.features["observation.state"]["names"] == JOINTS
    first = [ds[i] for i in range(8)]
    assert [bool(f["intervened"]) for f in first] == [False, False, True, True, True, False, False, False]
    assert np.allclose(first[3]["observation.state"].numpy(), [0.03, -0.3, 0.6], atol=1e-6)
    assert np.allclose(first[3]["action"].numpy(), [0.032, -0.298, 0.602], atol=1e-6)
    assert first[0]["task"] == "reach" and float(first[7]["next.reward"]) == 1.0
    last = ds[12]
    assert int(last["episode_index"]) == 1 and bool(last["next.done"]) and not bool(last["next.success"])
