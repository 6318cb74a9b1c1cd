"""Names that reach a process from the network resolve to installed code only: a robot gateway's Connect names a
registered driver or an entry point, never a module for the gateway (beside a physical arm) to import. Run specs
may name code by import path; that is the registry's point, and the gateway is not where run specs are read."""

from __future__ import annotations

import sys

import grpc
import pytest

from rlfabric.services.core.proto.rlfabric.v1 import robot_gateway_pb2 as pb
from rlfabric.services.robot_gateway.drivers import DRIVERS, driver_class
from tests.robot_support import gateway_in_process

SIDE_EFFECT = "import os\nopen(os.environ['RLF_IMPORTED'], 'w').close()\n\n\nclass Arm:\n    pass\n"


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """A module whose import leaves a file behind, on this process's path (as an installed package would be)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "rlf_test_trap.py").write_text(SIDE_EFFECT)
    marker = tmp_path / "imported"
    monkeypatch.setenv("RLF_IMPORTED", str(marker))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    yield marker
    sys.modules.pop("rlf_test_trap", None)


@pytest.mark.parametrize("name", ["rlf_test_trap:Arm", "rlf_test_trap", "rlfabric.services.robot_gateway.drivers.sim:SimArm"])
def test_a_driver_name_is_never_an_import_path(importable, name):
    with pytest.raises(ValueError, match=rf"driver {name!r} is not a registered driver; available: \["):
        driver_class(name)
    assert not importable.exists() and "rlf_test_trap" not in sys.modules
    assert "package.module:attr in the run spec" not in DRIVERS.unknown(name)


def test_a_connect_that_names_a_module_is_refused_and_imports_nothing(importable):
    with gateway_in_process() as (stub, _, _):
        with pytest.raises(grpc.RpcError) as err:
            stub.Connect(pb.ConnectRequest(robot_id="arm", driver="rlf_test_trap:Arm", control_hz=100,
                                           watchdog_s=0.1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a registered driver" in err.value.details()
    assert not importable.exists() and "rlf_test_trap" not in sys.modules


def test_an_installed_name_that_is_no_driver_is_refused_by_name(importable, monkeypatch):
    monkeypatch.setattr(DRIVERS, "_loaded", {})
    monkeypatch.setattr(DRIVERS, "_builtins", dict(DRIVERS._builtins))
    DRIVERS.register("trap", "rlf_test_trap:Arm")
    with pytest.raises(ValueError, match=r"driver 'trap': 'rlf_test_trap:Arm' is not a Driver subclass"):
        driver_class("trap")
