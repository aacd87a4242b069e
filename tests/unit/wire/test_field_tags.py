"""Every tag and field number the hand-made codec uses is the one protobuf uses for that field.

Each tag is compared with the first bytes protobuf itself writes for a
message holding only that field, so a field renumbered or retyped in
ps.proto shows up here as well as in the codec's import-time checks.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire import codec, small_messages
from wehub_ps.wire.protowire import WIRE_LEN, WIRE_VARINT, field_tag

# module, tag constant -> (message, field) it frames.
_TAGS = {
    (codec, "_TAG_TENSOR_CHUNK_HEADER"): (ps_pb2.TensorChunk, "header"),
    (codec, "_TAG_TENSOR_CHUNK_DATA"): (ps_pb2.TensorChunk, "data"),
    (codec, "_TAG_TENSOR_CHUNK_PAD"): (ps_pb2.TensorChunk, "pad"),
    (codec, "_TAG_CHUNK_BATCH_HEADERS"): (ps_pb2.ChunkBatch, "headers"),
    (codec, "_TAG_CHUNK_BATCH_DATA"): (ps_pb2.ChunkBatch, "data"),
    (codec, "_TAG_CHUNK_HEADERS_ITEMS"): (ps_pb2.ChunkHeaders, "items"),
    (codec, "_TAG_PULL_RESPONSE_CHUNKS"): (ps_pb2.PullResponse, "chunks"),
    (codec, "_TAG_PULL_RESPONSE_BATCHES"): (ps_pb2.PullResponse, "batches"),
    (codec, "_TAG_PUSH_REQUEST_BEGIN"): (ps_pb2.PushRequest, "begin"),
    (codec, "_TAG_PUSH_REQUEST_CHUNKS"): (ps_pb2.PushRequest, "chunks"),
    (codec, "_TAG_PUSH_REQUEST_BATCHES"): (ps_pb2.PushRequest, "batches"),
    (codec, "_TAG_PUSH_RESPONSE_PULLED"): (ps_pb2.PushResponse, "pulled"),
    (codec, "_TAG_ENVELOPE_ID"): (ps_pb2.ExchangeRequest, "id"),
    (small_messages, "_TAG_CHUNK_HEADER_VARIABLE"): (ps_pb2.ChunkHeader, "variable"),
    (small_messages, "_TAG_CHUNK_HEADER_OFFSET"): (ps_pb2.ChunkHeader, "offset"),
    (small_messages, "_TAG_CHUNK_HEADER_COUNT"): (ps_pb2.ChunkHeader, "count"),
    (small_messages, "_TAG_CHUNK_HEADER_DTYPE"): (ps_pb2.ChunkHeader, "dtype"),
    (small_messages, "_TAG_CHUNK_HEADER_VERSION"): (ps_pb2.ChunkHeader, "version"),
    (small_messages, "_TAG_CHUNK_HEADER_PART_ELEMENTS"): (ps_pb2.ChunkHeader, "part_elements"),
    (small_messages, "_TAG_PUSH_ITEM_VARIABLE"): (ps_pb2.PushItem, "variable"),
    (small_messages, "_TAG_PUSH_ITEM_ELEMENTS"): (ps_pb2.PushItem, "elements"),
    (small_messages, "_TAG_PUSH_ITEM_WIRE_DTYPE"): (ps_pb2.PushItem, "wire_dtype"),
    (small_messages, "_TAG_PUSH_ITEM_BASE_VERSION"): (ps_pb2.PushItem, "base_version"),
    (small_messages, "_TAG_PUSH_ITEM_ROW_IDS"): (ps_pb2.PushItem, "row_ids"),
    (small_messages, "_TAG_PUSH_BEGIN_WORKER_ID"): (ps_pb2.PushBegin, "worker_id"),
    (small_messages, "_TAG_PUSH_BEGIN_INCARNATION"): (ps_pb2.PushBegin, "incarnation"),
    (small_messages, "_TAG_PUSH_BEGIN_SEQUENCE"): (ps_pb2.PushBegin, "sequence"),
    (small_messages, "_TAG_PUSH_BEGIN_SHARD_INDEX"): (ps_pb2.PushBegin, "shard_index"),
    (small_messages, "_TAG_PUSH_BEGIN_NUM_SHARDS"): (ps_pb2.PushBegin, "num_shards"),
    (small_messages, "_TAG_PUSH_BEGIN_KIND"): (ps_pb2.PushBegin, "kind"),
    (small_messages, "_TAG_PUSH_BEGIN_ITEMS"): (ps_pb2.PushBegin, "items"),
    (small_messages, "_TAG_PUSH_BEGIN_STEP"): (ps_pb2.PushBegin, "step"),
    (small_messages, "_TAG_PUSH_BEGIN_PULL_AFTER"): (ps_pb2.PushBegin, "pull_after"),
    (small_messages, "_TAG_PUSH_BEGIN_CONTINUED"): (ps_pb2.PushBegin, "continued"),
    (small_messages, "_TAG_PULL_ITEM_VARIABLE"): (ps_pb2.PullItem, "variable"),
    (small_messages, "_TAG_PULL_ITEM_ROW_IDS"): (ps_pb2.PullItem, "row_ids"),
    (small_messages, "_TAG_PULL_REQUEST_SHARD_INDEX"): (ps_pb2.PullRequest, "shard_index"),
    (small_messages, "_TAG_PULL_REQUEST_NUM_SHARDS"): (ps_pb2.PullRequest, "num_shards"),
    (small_messages, "_TAG_PULL_REQUEST_ITEMS"): (ps_pb2.PullRequest, "items"),
    (small_messages, "_TAG_PULL_REQUEST_WIRE_DTYPE"): (ps_pb2.PullRequest, "wire_dtype"),
    (small_messages, "_TAG_PULL_REQUEST_CHUNK_BYTES"): (ps_pb2.PullRequest, "chunk_bytes"),
    (small_messages, "_TAG_PULL_REQUEST_WORKER_ID"): (ps_pb2.PullRequest, "worker_id"),
    (small_messages, "_TAG_PULL_REQUEST_INCARNATION"): (ps_pb2.PullRequest, "incarnation"),
    (small_messages, "_TAG_PULL_REQUEST_STEP"): (ps_pb2.PullRequest, "step"),
    (small_messages, "_TAG_PULL_REQUEST_LOOKUP"): (ps_pb2.PullRequest, "lookup"),
    (small_messages, "_TAG_PUSH_RESPONSE_VERSIONS"): (ps_pb2.PushResponse, "versions"),
    (small_messages, "_TAG_PUSH_RESPONSE_DUPLICATE"): (ps_pb2.PushResponse, "duplicate"),
    (small_messages, "_TAG_PUSH_RESPONSE_ELEMENTS_APPLIED"): (ps_pb2.PushResponse, "elements_applied"),
    (small_messages, "_TAG_PUSH_RESPONSE_DROPPED"): (ps_pb2.PushResponse, "dropped"),
    (small_messages, "_TAG_PUSH_RESPONSE_CLUSTER_STEP"): (ps_pb2.PushResponse, "cluster_step"),
    (small_messages, "_TAG_VARIABLE_VERSION_VARIABLE"): (ps_pb2.VariableVersion, "variable"),
    (small_messages, "_TAG_VARIABLE_VERSION_VERSION"): (ps_pb2.VariableVersion, "version"),
}

# codec constant -> (message, field) whose number the decoders compare with.
_NUMBERS = {
    "_PULL_RESPONSE_CHUNKS": (ps_pb2.PullResponse, "chunks"),
    "_PULL_RESPONSE_BATCHES": (ps_pb2.PullResponse, "batches"),
    "_PUSH_REQUEST_BEGIN": (ps_pb2.PushRequest, "begin"),
    "_PUSH_REQUEST_CHUNKS": (ps_pb2.PushRequest, "chunks"),
    "_PUSH_REQUEST_BATCHES": (ps_pb2.PushRequest, "batches"),
    "_PUSH_RESPONSE_PULLED": (ps_pb2.PushResponse, "pulled"),
    "_ENVELOPE_ID": (ps_pb2.ExchangeResponse, "id"),
    "EXCHANGE_PULL": (ps_pb2.ExchangeResponse, "pull"),
    "EXCHANGE_PUSH": (ps_pb2.ExchangeResponse, "push"),
    "EXCHANGE_ERROR": (ps_pb2.ExchangeResponse, "error"),
}


def _protobuf_bytes_of(message_class: type, name: str) -> bytes:
    """A message with only field ``name`` set (to a non-default value), as protobuf serialises it."""
    message = message_class()
    field = message_class.DESCRIPTOR.fields_by_name[name]
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.is_repeated:
            getattr(message, name).add()
        else:
            getattr(message, name).SetInParent()
    elif field.type == FieldDescriptor.TYPE_STRING:
        setattr(message, name, "x")
    elif field.type == FieldDescriptor.TYPE_BYTES:
        setattr(message, name, b"x")
    elif field.type == FieldDescriptor.TYPE_BOOL:
        setattr(message, name, True)
    else:
        setattr(message, name, 1)
    return message.SerializeToString()


def test_every_tag_constant_of_the_codec_is_checked_here():
    for module in (codec, small_messages):
        constants = {name for name in vars(module) if name.startswith("_TAG_")}
        assert constants == {name for owner, name in _TAGS if owner is module}


@pytest.mark.parametrize(("module", "constant"), list(_TAGS), ids=[name for _, name in _TAGS])
def test_each_tag_is_the_one_protobuf_writes_for_its_field(module, constant):
    message_class, name = _TAGS[(module, constant)]
    written = getattr(module, constant)
    assert _protobuf_bytes_of(message_class, name).startswith(written)


@pytest.mark.parametrize("constant", list(_NUMBERS))
def test_each_field_number_the_decoders_read_is_the_descriptors(constant):
    message_class, name = _NUMBERS[constant]
    assert getattr(codec, constant) == message_class.DESCRIPTOR.fields_by_name[name].number


def test_the_envelope_fields_are_numbered_alike_in_requests_and_responses():
    for name in ("id", "pull", "push"):
        request = ps_pb2.ExchangeRequest.DESCRIPTOR.fields_by_name[name].number
        assert request == ps_pb2.ExchangeResponse.DESCRIPTOR.fields_by_name[name].number


def test_the_tensor_chunk_and_chunk_batch_fields_are_the_descriptors():
    assert codec._TENSOR_CHUNK_FIELDS == (ps_pb2.TensorChunk.DESCRIPTOR.fields_by_name["header"].number,
                                          ps_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number)
    assert codec._CHUNK_BATCH_FIELDS == (ps_pb2.ChunkBatch.DESCRIPTOR.fields_by_name["headers"].number,
                                         ps_pb2.ChunkBatch.DESCRIPTOR.fields_by_name["data"].number)


@pytest.mark.parametrize(("message_class", "name", "wire_type"), [
    (ps_pb2.ChunkHeader, "offset", WIRE_LEN),
    (ps_pb2.ChunkHeader, "variable", WIRE_VARINT),
    (ps_pb2.PushBegin, "items", WIRE_VARINT),
    (ps_pb2.TensorChunk, "data", WIRE_VARINT),
])
def test_a_field_is_refused_with_a_wire_type_its_type_is_not_written_with(message_class, name, wire_type):
    with pytest.raises(TypeError, match=name):
        field_tag(message_class, name, wire_type)


def test_the_cores_row_lookup_values_are_the_protos():
    """ps_server.core.pulls may not import the stubs: its RowLookup numbers must stay the proto's."""
    from ps_server.core.pulls import LOOKUP_CREATE, LOOKUP_READ_ONLY, LOOKUP_READ_ONLY_ZEROS

    assert (LOOKUP_CREATE, LOOKUP_READ_ONLY, LOOKUP_READ_ONLY_ZEROS) == (
        ps_pb2.ROW_LOOKUP_CREATE, ps_pb2.ROW_LOOKUP_READ_ONLY, ps_pb2.ROW_LOOKUP_READ_ONLY_ZEROS)
    assert len(ps_pb2.RowLookup.values()) == 3
