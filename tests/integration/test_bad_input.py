"""Bad input gets a precise status and message, changes nothing, and the server keeps serving.

These tests speak raw gRPC (bytes in, bytes out) so that they can send what
the real client never would.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.specs import SGD, VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, decode_pull_response, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import PSClient

StatusCode = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ps_testing import ClusterFactory

    factory = ClusterFactory(tmp_path_factory.mktemp("bad-input"))
    cluster = factory(1, "--max-memory-bytes", str(256 << 20))
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(600, 300), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        client.create_variable("b", shape=(7,), initializer="normal")
    yield cluster.servers[0]
    factory.stop_all()


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _state(server) -> dict:
    with PSClient([server.address]) as client:
        values = client.pull()
        info = client.describe()[0].variables
    return {"values": {k: v.tobytes() for k, v in values.items()},
            "versions": {k: (v["version"], v["optimizer_steps"]) for k, v in info.items()}}


@pytest.fixture
def unchanged(server):
    """Asserts after the test that stored values, versions and health are as before."""
    before = _state(server)
    yield
    assert _state(server) == before
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def _reason(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY)


def _expect(call, code: StatusCode, reason: str, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == code, error.details()
    assert _reason(error) == reason
    assert fragment in error.details(), error.details()


def _create(channel, spec: ps_pb2.VariableSpec, shard=(0, 1)):
    request = ps_pb2.CreateVariableRequest(spec=spec, shard_index=shard[0], num_shards=shard[1])
    return channel.unary_unary(method_path("CreateVariable"))(request.SerializeToString(), timeout=10)


def _push(channel, begin: ps_pb2.PushBegin, chunks: list[OutgoingChunk]):
    messages = [encode_push_request(begin, chunks)]
    return channel.stream_unary(method_path("Push"))(iter(messages), timeout=10)


def _begin(variable: str = "w", elements: int = 180_000, dtype: int = ps_pb2.FLOAT32, **kw) -> ps_pb2.PushBegin:
    fields = dict(worker_id="tester", incarnation="i1", sequence=kw.pop("sequence", 1), shard_index=0,
                  num_shards=1, kind=ps_pb2.GRADIENT)
    fields.update(kw)
    return ps_pb2.PushBegin(items=[ps_pb2.PushItem(variable=variable, elements=elements, wire_dtype=dtype)],
                            **fields)


def _chunk(variable: str, offset: int, values: np.ndarray, count: int | None = None) -> OutgoingChunk:
    header = ps_pb2.ChunkHeader(variable=variable, offset=offset,
                                count=values.size if count is None else count, dtype=ps_pb2.FLOAT32)
    return OutgoingChunk(header, byte_view(np.ascontiguousarray(values)))


GARBAGE = b"\x0a\xff\xff\xff\xff\x0f\x01"  # a length-delimited field longer than the message


@pytest.mark.parametrize("method,kind", [("Describe", "unary"), ("CreateVariable", "unary"),
                                         ("Pull", "stream_out"), ("Push", "stream_in"),
                                         ("ExportRows", "stream_out")])
def test_a_request_that_is_not_a_message_at_all(channel, unchanged, method, kind):
    def call():
        if kind == "unary":
            return channel.unary_unary(method_path(method))(GARBAGE, timeout=10)
        if kind == "stream_out":
            return list(channel.unary_stream(method_path(method))(GARBAGE, timeout=10))
        return channel.stream_unary(method_path(method))(iter([GARBAGE]), timeout=10)
    _expect(call, StatusCode.INVALID_ARGUMENT, "MALFORMED_MESSAGE", "not a valid")


def test_pull_of_unknown_variable(channel, unchanged):
    request = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="nope")])
    _expect(lambda: list(channel.unary_stream(method_path("Pull"))(request.SerializeToString(), timeout=10)),
            StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE", "'nope' does not exist")


def test_pull_with_an_unknown_row_lookup(channel, unchanged):
    request = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="b")], lookup=7)
    _expect(lambda: list(channel.unary_stream(method_path("Pull"))(request.SerializeToString(), timeout=10)),
            StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "unknown row lookup 7")


@pytest.mark.parametrize("variable,shards,code,reason,fragment", [
    ("nope", (0, 1), StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE", "'nope' does not exist"),
    ("b", (0, 1), StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "is a dense variable: pull it"),
    ("b", (1, 2), StatusCode.FAILED_PRECONDITION, "CLUSTER_MISMATCH", "shard 0 of 1")])
def test_export_rows_of_what_is_not_a_hash_table_here(channel, unchanged, variable, shards, code, reason, fragment):
    request = ps_pb2.ExportRowsRequest(variable=variable, shard_index=shards[0], num_shards=shards[1])
    _expect(lambda: list(channel.unary_stream(method_path("ExportRows"))(request.SerializeToString(), timeout=10)),
            code, reason, fragment)


def test_push_to_unknown_variable(channel, unchanged):
    _expect(lambda: _push(channel, _begin("nope", 3), [_chunk("nope", 0, np.ones(3, np.float32))]),
            StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE", "'nope'")


def test_push_with_wrong_shape(channel, unchanged):
    _expect(lambda: _push(channel, _begin("w", 1000), [_chunk("w", 0, np.ones(1000, np.float32))]),
            StatusCode.INVALID_ARGUMENT, "SHAPE_MISMATCH", "has 180000")


def test_push_with_wrong_dtype(channel, unchanged):
    _expect(lambda: _push(channel, _begin("w", dtype=ps_pb2.INT32), []),
            StatusCode.INVALID_ARGUMENT, "DTYPE_MISMATCH", "got int32")


def test_conflicting_create(channel, unchanged):
    spec = spec_to_proto(VariableSpec("w", (600, 301), "float32"))
    _expect(lambda: _create(channel, spec), StatusCode.ALREADY_EXISTS, "SPEC_CONFLICT", "shape")


def test_invalid_spec(channel, unchanged):
    spec = spec_to_proto(VariableSpec("fresh", (3,), "float32"))
    spec.optimizer.sgd.learning_rate = -1
    _expect(lambda: _create(channel, spec), StatusCode.INVALID_ARGUMENT, "INVALID_SPEC", "learning_rate")
    bad_name = spec_to_proto(VariableSpec("fresh", (3,), "float32"))
    bad_name.name = "has space"
    _expect(lambda: _create(channel, bad_name), StatusCode.INVALID_ARGUMENT, "INVALID_SPEC", "has space")


@pytest.mark.parametrize("field,value,fragment", [
    ("admission.probability", 1.5, "Admission.probability"),
    ("admission.counters", 8, "Admission.counters"),
    ("admission.min_count", 70_000, "Admission.min_count"),
    ("expiry.seconds", float("nan"), "Expiry.seconds"),
    ("tier.memory_rows", 0, "DiskTier.memory_rows"),
])
def test_invalid_row_policies(channel, unchanged, field, value, fragment):
    spec = spec_to_proto(VariableSpec("fresh_table", (4,), "float32", hash_table=True))
    message, attribute = field.split(".")
    getattr(spec, message).SetInParent()
    setattr(getattr(spec, message), attribute, value)
    _expect(lambda: _create(channel, spec), StatusCode.INVALID_ARGUMENT, "INVALID_SPEC", fragment)


def test_row_policies_on_a_dense_variable_or_a_server_without_a_disk_tier(channel, unchanged):
    dense = spec_to_proto(VariableSpec("fresh_dense", (4, 4), "float32"))
    dense.expiry.steps = 3
    _expect(lambda: _create(channel, dense), StatusCode.INVALID_ARGUMENT, "INVALID_SPEC", "hash tables only")
    tiered = spec_to_proto(VariableSpec("fresh_tiered", (4,), "float32", hash_table=True))
    tiered.tier.memory_rows = 10
    _expect(lambda: _create(channel, tiered), StatusCode.FAILED_PRECONDITION, "DISK_TIER_DISABLED",
            "--disk-tier-dir")


def test_an_admission_filter_past_the_memory_limit(channel, unchanged):
    spec = spec_to_proto(VariableSpec("filtered", (4,), "float32", hash_table=True))
    spec.admission.min_count = 2
    spec.admission.probability = 1.0
    spec.admission.counters = 1 << 26  # 512 MiB of counters: past the 256 MiB budget
    _expect(lambda: _create(channel, spec), StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT", "filtered")


def test_chunk_offset_out_of_range(channel, unchanged):
    _expect(lambda: _push(channel, _begin(sequence=2), [_chunk("w", 179_999, np.ones(2, np.float32))]),
            StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "outside the 180000 elements")


def test_chunk_length_does_not_match_its_bytes(channel, unchanged):
    _expect(lambda: _push(channel, _begin(sequence=3), [_chunk("w", 0, np.ones(10, np.float32), count=12)]),
            StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "carries 40 bytes")


def test_chunk_for_undeclared_variable(channel, unchanged):
    _expect(lambda: _push(channel, _begin(sequence=4), [_chunk("b", 0, np.ones(7, np.float32))]),
            StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "did not declare")


def test_declared_size_that_would_exhaust_memory(channel, unchanged):
    spec = spec_to_proto(VariableSpec("huge", (2**40,), "float32"))
    _expect(lambda: _create(channel, spec), StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT", "--max-memory-bytes")
    adam = spec_to_proto(VariableSpec("huge2", (40_000_000,), "float32"))  # 160 MB + slots > 256 MiB budget
    adam.optimizer.adam.learning_rate = 0.001
    adam.optimizer.adam.beta_1 = 0.9
    adam.optimizer.adam.beta_2 = 0.999
    adam.optimizer.adam.epsilon = 1e-7
    _expect(lambda: _create(channel, adam), StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT", "huge2")


def test_request_for_another_cluster_layout(channel, unchanged):
    spec = spec_to_proto(VariableSpec("fresh", (3,), "float32"))
    _expect(lambda: _create(channel, spec, shard=(1, 2)), StatusCode.FAILED_PRECONDITION,
            "CLUSTER_MISMATCH", "shard 0 of 1")


def test_push_without_begin_and_empty_push(channel, unchanged):
    no_begin = [encode_push_request(None, [_chunk("w", 0, np.ones(3, np.float32))])]
    _expect(lambda: channel.stream_unary(method_path("Push"))(iter(no_begin), timeout=10),
            StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "must carry PushBegin")
    _expect(lambda: channel.stream_unary(method_path("Push"))(iter([]), timeout=10),
            StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "empty push stream")


def test_a_continued_push_begin_that_is_not_completed_properly(channel, unchanged):
    """PushBegin.continued: each misuse is refused before anything is applied."""
    def rows(*ids: int) -> bytes:
        return np.array(ids, "<i8").tobytes()

    first = ps_pb2.PushBegin(worker_id="tester", incarnation="i-cont", sequence=1, shard_index=0,
                             num_shards=1, kind=ps_pb2.GRADIENT, continued=True,
                             items=[ps_pb2.PushItem(variable="w", elements=300, wire_dtype=ps_pb2.FLOAT32,
                                                    row_ids=rows(3))])
    more = ps_pb2.PushBegin(items=[ps_pb2.PushItem(variable="w", elements=300, row_ids=rows(4))],
                            continued=True)
    undeclared = ps_pb2.PushBegin(items=[ps_pb2.PushItem(variable="b", elements=7, row_ids=rows(0))])
    no_rows = ps_pb2.PushBegin(items=[ps_pb2.PushItem(variable="w", elements=300)])
    values = _chunk("w", 0, np.ones(300, np.float32))
    opening = encode_push_request(first, [])
    cases = [
        ([encode_push_request(first, [values])], "chunks may only follow the last part"),
        ([opening, encode_push_request(undeclared, [])], "the first part did not declare"),
        ([opening, encode_push_request(no_rows, [])], "must carry row ids"),
        ([opening, encode_push_request(None, [values])], "must be continued by the next"),
        ([opening], "ended before the last part"),
        ([opening, encode_push_request(more, [])], "ended before the last part"),
    ]
    for messages, fragment in cases:
        _expect(lambda: channel.stream_unary(method_path("Push"))(iter(messages), timeout=10),
                StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", fragment)


def test_a_valid_push_after_all_that_still_applies(server):
    with PSClient([server.address]) as client:
        before = client.pull(["w"])["w"]
        client.push({"w": np.ones((600, 300), np.float32)})
        np.testing.assert_array_equal(client.pull(["w"])["w"], before - 1)


def test_the_exchange_stream_answers_bad_requests_and_carries_on(channel, unchanged):
    from wehub_ps.wire.codec import EXCHANGE_ERROR, EXCHANGE_PULL, decode_envelope, encode_envelope

    pull = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="b")])
    unknown = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="nope")])
    requests = [GARBAGE, encode_envelope(2, EXCHANGE_PULL, unknown.SerializeToString()),
                encode_envelope(3, EXCHANGE_PULL, pull.SerializeToString())]
    answers = list(channel.stream_stream(method_path("Exchange"))(iter(requests), timeout=10))
    assert len(answers) == 3
    errors = [ps_pb2.ExchangeError.FromString(decode_envelope(a)[2]) for a in answers[:2]]
    assert [decode_envelope(a)[1] for a in answers[:2]] == [EXCHANGE_ERROR, EXCHANGE_ERROR]
    assert (errors[0].code, errors[0].reason) == (StatusCode.INVALID_ARGUMENT.value[0], "MALFORMED_MESSAGE")
    assert (errors[1].code, errors[1].reason) == (StatusCode.NOT_FOUND.value[0], "UNKNOWN_VARIABLE")
    request_id, field, payload = decode_envelope(answers[2])
    assert (request_id, field) == (3, EXCHANGE_PULL)
    assert decode_pull_response(payload)[0].header.count == 7
