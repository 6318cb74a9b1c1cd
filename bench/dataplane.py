"""Data-plane throughput: TensorBatch request/ack over rlfabric's DataClient/DataServer next to raw pyzmq
DEALER/ROUTER moving the same bytes with the same ack pattern, each across two processes on loopback.

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


def serve(kind: str) -> None:
    if kind == "ours":
        from services.core.batch import TensorBatch
        from services.core.dataplane import DataServer

        server = DataServer(max_bytes=1 << 30, name="bench")
        print(server.endpoint, flush=True)
        server.serve(lambda k, b, reply: reply.send("ack", TensorBatch(meta={"n": int(b["x"].nbytes)})))
    else:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        print(f"tcp://127.0.0.1:{port}", flush=True)
        while True:
            frames = sock.recv_multipart(copy=False)
            sock.send_multipart([frames[0], b"ack"])


def measure(kind: str, mib: int, seconds: float) -> float:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        payload = np.random.default_rng(0).integers(0, 255, size=mib * 2**20, dtype=np.uint8)
        if kind == "ours":
            from services.core.batch import TensorBatch
            from services.core.dataplane import DataClient

            client = DataClient(endpoint, max_bytes=1 << 30)

            def one() -> None:
                client.request("put", TensorBatch({"x": payload}, version=1))
        else:
            sock = zmq.Context.instance().socket(zmq.DEALER)
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
    raw, ours = [], []
    for _ in range(args.rounds):  # alternate so drift on the machine hits both sides alike; compare medians
        raw.append(measure("raw", args.mib, args.seconds / args.rounds))
        ours.append(measure("ours", args.mib, args.seconds / args.rounds))
    result = {"mib": args.mib, "ours_mib_s": statistics.median(ours), "raw_mib_s": statistics.median(raw),
              "ours_rounds_mib_s": ours, "raw_rounds_mib_s": raw}
    if args.json:
        print(json.dumps(result))
        return
    from common import report

    report("dataplane", result, {"dataplane_vs_raw_pyzmq": result["ours_mib_s"] / result["raw_mib_s"]},
           {"dataplane_vs_raw_pyzmq": ">=0.9"}, args.out)


if __name__ == "__main__":
    main()
