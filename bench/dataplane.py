"""Data-plane throughput: TensorBatch request/ack over rlfabric's DataClient/DataServer next to raw pyzmq
DEALER/ROUTER moving the same bytes with the same ack pattern, each across two processes on loopback; in the
clear and with CURVE (what a deployment with a secret runs: the raw side then uses the same CURVE keys), each
compared with raw pyzmq under the same security.

    python bench/dataplane.py --mib 4 --seconds 3 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


TOKEN_ENV = "RLFABRIC_BENCH_TOKEN"


def _security() -> None:
    """Both processes of a secure measurement derive the same CURVE keys from one token."""
    import os

    from rlfabric.services.core import auth

    auth.configure(os.environ.get(TOKEN_ENV, ""))


def serve(kind: str) -> None:
    _security()
    if kind == "ours":
        from rlfabric.services.core.batch import TensorBatch
        from rlfabric.services.core.dataplane import DataServer

        server = DataServer(max_bytes=1 << 30, name="bench")
        print(server.endpoint, flush=True)
        server.serve(lambda k, b, reply: reply.send("ack", TensorBatch(meta={"n": int(b["x"].nbytes)})))
    else:
        from rlfabric.services.core import auth

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        auth.secure_server_socket(sock)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        print(f"tcp://127.0.0.1:{port}", flush=True)
        while True:
            frames = sock.recv_multipart(copy=False)
            sock.send_multipart([frames[0], b"ack"])


def measure(kind: str, mib: int, seconds: float, token: str = "") -> float:
    import os

    os.environ[TOKEN_ENV] = token
    _security()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        payload = np.random.default_rng(0).integers(0, 255, size=mib * 2**20, dtype=np.uint8)
        if kind == "ours":
            from rlfabric.services.core.batch import TensorBatch
            from rlfabric.services.core.dataplane import DataClient

            client = DataClient(endpoint, max_bytes=1 << 30)

            def one() -> None:
                client.request("put", TensorBatch({"x": payload}, version=1))
        else:
            from rlfabric.services.core import auth

            sock = zmq.Context.instance().socket(zmq.DEALER)
            auth.secure_client_socket(sock)
            sock.connect(endpoint)

            def one() -> None:
                sock.send_multipart([b'{"w":1}', payload], copy=False)
                sock.recv_multipart()
        for _ in range(5):
            one()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            one()
            n += 1
        return n * mib / (time.perf_counter() - t0)
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", default="")
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per side")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds per side (medians compared)")
    parser.add_argument("--json", action="store_true", help="print one JSON line (for other benches)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    from rlfabric.services.core.auth import generate_token

    token = generate_token()
    rounds: dict[str, list[float]] = {"raw": [], "ours": [], "raw_curve": [], "ours_curve": []}
    for _ in range(args.rounds):  # alternate so drift on the machine hits every side alike; compare medians
        for name in rounds:
            side, secure = name.split("_")[0], name.endswith("curve")
            rounds[name].append(measure(side, args.mib, args.seconds / args.rounds, token if secure else ""))
    result = {"mib": args.mib, **{f"{name}_mib_s": statistics.median(r) for name, r in rounds.items()},
              **{f"{name}_rounds_mib_s": r for name, r in rounds.items()}}
    if args.json:
        print(json.dumps(result))
        return
    from common import report

    report("dataplane", result, {
        "dataplane_vs_raw_pyzmq": result["ours_mib_s"] / result["raw_mib_s"],
        "dataplane_curve_vs_raw_pyzmq_curve": result["ours_curve_mib_s"] / result["raw_curve_mib_s"],
    }, {"dataplane_vs_raw_pyzmq": ">=0.9", "dataplane_curve_vs_raw_pyzmq_curve": ">=0.9"}, args.out)


if __name__ == "__main__":
    main()
