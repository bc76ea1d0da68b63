"""The committed stubs are what the .proto generates, and the proto keeps its rules."""
import pytest

from jaxserve.v1 import jaxserve_pb2 as pb


def test_generated_stubs_are_not_stale(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs")
    from jaxserve.server.gen_protos import GENERATED, REPO, generate

    fresh = generate(tmp_path)
    for path in fresh:
        committed = REPO / "jaxserve" / "v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run `python -m jaxserve.server.gen_protos` and commit the result")
    assert sorted(p.name for p in fresh) == sorted(GENERATED)


def test_every_sampling_and_stop_scalar_is_optional():
    # A proto3 zero must never stand in for "unset": every scalar knob tracks presence.
    for msg in (pb.SamplingParams, pb.StopCriteria):
        for field in msg.DESCRIPTOR.fields:
            if not field.is_repeated:
                assert field.has_presence, f"{msg.DESCRIPTOR.name}.{field.name} must be `optional`"


def test_package_and_service_names():
    assert pb.DESCRIPTOR.package == "jaxserve.v1"
    assert pb.DESCRIPTOR.name == "jaxserve/v1/jaxserve.proto"
    assert "JaxServe" in pb.DESCRIPTOR.services_by_name
