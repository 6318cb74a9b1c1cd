"""Connect's status codes say whose fault a failed driver start is (issue 39, finding 11): a simulator that raised a
ValueError of its own was reported as INVALID_ARGUMENT, blaming the caller. Now the request's options
(DriverOptionError, a connection to the address they name, an option the driver does not take) are
INVALID_ARGUMENT, a library this host lacks is FAILED_PRECONDITION, and any other failure of the driver or its
device is INTERNAL, saying the request is not at fault; none of them leaves a robot behind."""

from __future__ import annotations

import grpc
import pytest

from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from rlfabric.services.robot_gateway.drivers import (
    Driver,
    DriverConnectionError,
    DriverOptionError,
    DriverUnavailable,
    register_driver,
)
from tests.robot_support import gateway_in_process


class FailingDriver(Driver):
    """Fails its start the way ``options["fail"]`` names."""

    def __init__(self, fail: str = "option"):
        raise {"option": DriverOptionError("options.fail: not a way to fail. Fix: another"),
               "connect": DriverConnectionError("options.ip=10.9.9.9: nothing answers"),
               "library": DriverUnavailable("needs the franky package. Fix: pip install franky-control"),
               "simulator": ValueError("mj_forward: the model's inertia is not positive definite"),
               "device": RuntimeError("the controller reported a reflex error")}[fail]


register_driver("failing", f"{__name__}:FailingDriver")


@pytest.mark.parametrize("fail, code, named", [
    ("option", grpc.StatusCode.INVALID_ARGUMENT, "options.fail"),
    ("connect", grpc.StatusCode.INVALID_ARGUMENT, "nothing answers"),
    ("library", grpc.StatusCode.FAILED_PRECONDITION, "pip install franky-control"),
    ("simulator", grpc.StatusCode.INTERNAL, "not of this request"),
    ("device", grpc.StatusCode.INTERNAL, "RuntimeError: the controller reported a reflex error"),
])
def test_a_failed_driver_start_blames_whoever_can_fix_it(fail, code, named):
    with gateway_in_process() as (stub, service, _):
        with pytest.raises(grpc.RpcError) as err:
            stub.Connect(pb.ConnectRequest(robot_id="arm", driver="failing", options={"fail": fail}), timeout=30)
        assert err.value.code() == code and named in err.value.details(), (err.value.code(), err.value.details())
        assert not service.loops  # nothing half-built stays connected


def test_options_a_driver_does_not_take_and_a_bad_sim_start_are_the_callers_to_fix():
    pytest.importorskip("mujoco")
    with gateway_in_process() as (stub, _, _):
        for driver, options, named in [("failing", {"colour": "red"}, "colour"),
                                       ("sim", {"start": "0,nan,1"}, "options.start"),
                                       ("sim", {"start": "0,1"}, "3 finite comma-separated joint positions")]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Connect(pb.ConnectRequest(robot_id="arm", driver=driver, options=options), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in err.value.details(), \
                (driver, err.value.details())
