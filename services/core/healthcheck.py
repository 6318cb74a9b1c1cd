"""``python -m rlfabric.services.core.healthcheck HOST:PORT [--timeout S] [--service NAME]``

Asks a service's standard gRPC health service (grpc.health.v1) whether it is SERVING. Container health checks
and scripts use it because it needs nothing but grpcio (no grpcurl or grpc_health_probe in the image).
Exit codes: 0 SERVING; 1 anything else, with a one-line reason on stderr; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfabric.services.core import auth


def check(address: str, timeout_s: float = 3.0, service: str = "") -> tuple[bool, str]:
    """One Check call, no retries: a health probe should report the state now, not wait for a better one. The
    deployment's token (RLFABRIC_TOKEN / RLFABRIC_TOKEN_FILE) and TLS files (RLFABRIC_TLS_*) come along."""
    with auth.sync_channel(address, [], auth.from_environment()) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s)
        except grpc.RpcError as exc:
            details = (exc.details() or "").splitlines()[0] if exc.details() else ""
            return False, f"{address}: {exc.code().name}" + (f": {details}" if details else "")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def _address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. coordinator:50051, got {text!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfabric.services.core.healthcheck",
                                     description="exit 0 if the service at HOST:PORT reports SERVING, else 1")
    parser.add_argument("address", type=_address, metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--service", default="", help="health service name (default: the whole server)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    ok, reason = check(args.address, args.timeout, args.service)
    print(reason, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
