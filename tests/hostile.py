"""Hostile data-plane messages, shared by the unit and integration tests: each a list of raw frames a peer could
send. None may kill a receiving loop; every one that has a sequence number gets an error reply."""

from __future__ import annotations

import json

import numpy as np

from rlfabric.services.core.batch import TensorBatch
from rlfabric.services.core.codec import encode


def _header(**patch) -> bytes:
    doc = {"w": 2, "kind": "put", "seq": 1, "version": 0, "meta": {}, "dims": [], "tensors": []}
    doc.update(patch)
    return json.dumps(doc).encode()


def _raw(header: str) -> bytes:
    return header.encode()


DEPTH = 20_000  # within the 64 KiB header bound, far past any recursion limit
KILLERS = {
    # the three that used to end a service's receiving thread, and their relatives
    "deeply nested header": [_raw('{"w":2,"kind":"x","seq":1,"version":0,"meta":' + "[" * DEPTH + "]" * DEPTH
                                  + ',"tensors":[]}')],
    "deeply nested meta object": [_raw('{"w":2,"kind":"x","seq":1,"version":0,"meta":' + '{"a":' * 3000 + "1"
                                       + "}" * 3000 + ',"tensors":[]}')],
    "shape product overflows": [_header(tensors=[{"name": "a", "dtype": "float32", "shape": [2**62, 2**62, 0]}]),
                                b""],
    "shape product beyond the message": [_header(tensors=[{"name": "a", "dtype": "uint8",
                                                           "shape": [2**20, 2**20, 2**20]}]), b"\0" * 8],
    "absurd sequence number": [_raw('{"w":2,"kind":"x","seq":' + "9" * 5000 + ',"version":0,"meta":{},"tensors":[]}')],
    "sequence number beyond 64 bits": [_header(seq=2**70)],
    "infinite sequence number": [_raw('{"w":2,"kind":"x","seq":1e999,"version":0,"meta":{},"tensors":[]}')],
    "NaN in meta": [_raw('{"w":2,"kind":"x","seq":1,"version":0,"meta":{"wait_s":NaN},"tensors":[]}')],
}
MALFORMED = {  # the decoder refuses these, whatever service receives them
    **KILLERS,
    "not json": [b"\xff\xfe garbage"],
    "empty header": [b""],
    "header is a list": [b"[1, 2, 3]"],
    "wrong wire version": [_header(w=99)],
    "negative dim": [_header(tensors=[{"name": "a", "dtype": "uint8", "shape": [-1]}]), b""],
    "bool dim": [_header(tensors=[{"name": "a", "dtype": "uint8", "shape": [True]}]), b"\0"],
    "unknown dtype": [_header(tensors=[{"name": "a", "dtype": "object", "shape": [1]}]), b"\0"],
    "buffer count mismatch": [_header(tensors=[{"name": "a", "dtype": "uint8", "shape": [1]}])],
    "byte count mismatch": [_header(tensors=[{"name": "a", "dtype": "float64", "shape": [4]}]), b"\0" * 7],
    "duplicate names": [_header(tensors=[{"name": "a", "dtype": "uint8", "shape": [1]}] * 2), b"\0", b"\0"],
    "empty name part": [_header(tensors=[{"name": "obs//x", "dtype": "uint8", "shape": [1]}]), b"\0"],
    "ragged lengths negative": [_header(dims=["sample"], tensors=[{"name": "t", "dtype": "int64", "shape": [1],
                                                                   "lengths": [2]}]),
                                np.zeros(1, np.int64).tobytes(), np.array([2, -1], np.int64).tobytes()],
    "ragged lengths do not add up": [_header(dims=["sample"], tensors=[{"name": "t", "dtype": "int64", "shape": [3],
                                                                        "lengths": [2]}]),
                                     np.zeros(3, np.int64).tobytes(), np.array([1, 1], np.int64).tobytes()],
    "inconsistent batch dims": [_header(dims=["time", "env"], tensors=[
        {"name": "a", "dtype": "uint8", "shape": [2, 3]}, {"name": "b", "dtype": "uint8", "shape": [2, 4]}]),
        b"\0" * 6, b"\0" * 8],
    "undeclared field dim": [_header(dims=["sample"], tensors=[{"name": "a", "dtype": "uint8", "shape": [1],
                                                                "dims": ["env"]}]), b"\0"],
    "too many frames": [_header()] + [b""] * 9000,
}
REQUESTS = {  # well-formed but hostile requests: the services' handlers refuse them
    "meta of wrong types": [_header(kind="get", meta={"min_version": "x", "wait_s": [1], "n": {"a": 1},
                                                      "pool": 5, "seed": -3})],
    "sample absurd count": encode("sample", TensorBatch(meta={"n": 2**40})),
    "sample unknown source": encode("sample", TensorBatch(meta={"n": 4, "source": "../../etc"})),
    "get waits an hour and more": encode("get", TensorBatch(meta={"min_version": 0, "wait_s": 1e9})),
    "reset a thousand envs": encode("reset", TensorBatch(meta={"pool": "train/3", "num_envs": 100_000})),
    "reset an unbounded pool name": encode("reset", TensorBatch(meta={"pool": "train/" + "9" * 40})),
    "step without actions": encode("step", TensorBatch(meta={"pool": "eval"})),
    "put without dims": encode("put", TensorBatch({"obs": np.zeros((2, 2), np.float32)}, version=0)),
    "put without version": encode("put", TensorBatch({"obs": np.zeros((2, 2), np.float32)}, dims=("sample",))),
    "unknown kind": encode("launch-missiles", TensorBatch()),
}
CORPUS = {**MALFORMED, **REQUESTS}


def data_ports(workers: dict, run_dir, config=None) -> dict[str, str]:
    """The data ports of a live stack's env, replay and learner (the learner's weight port exists once it is
    configured): each service configured by hand for a short CartPole run (or ``config``), as a coordinator would."""
    from rlfabric.services.core.proto.rlfabric.v1 import (
        common_pb2,
        env_pb2_grpc,
        learner_pb2_grpc,
        replay_pb2_grpc,
    )
    from tests.conftest import grpc_channel, short_config

    req = dict(run_id="t-hostile", config_json=(config or short_config()).to_json())
    with grpc_channel(workers["env"].endpoint.grpc) as ch:
        env_spec = json.loads(env_pb2_grpc.EnvStub(ch).Configure(common_pb2.ConfigureRequest(**req), timeout=30)
                              .detail_json)
    with grpc_channel(workers["replay"].endpoint.grpc) as ch:
        replay = replay_pb2_grpc.ReplayStub(ch).Configure(common_pb2.ConfigureRequest(**req), timeout=30)
    with grpc_channel(workers["learner"].endpoint.grpc) as ch:
        learner = learner_pb2_grpc.LearnerStub(ch).Configure(common_pb2.ConfigureRequest(
            **req, peers={"replay": replay.data_endpoint},
            context_json=json.dumps({"env_spec": env_spec, "run_dir": str(run_dir)})), timeout=60)
    return {"env": workers["env"].endpoint.data, "replay": replay.data_endpoint, "learner": learner.data_endpoint}
