"""Names and transport settings of the ParameterServer service."""

from __future__ import annotations

from wehub_ps.v1 import ps_pb2

__all__ = ["SERVICE_NAME", "method_path", "DEFAULT_CHUNK_BYTES", "MAX_MESSAGE_BYTES",
           "INCARNATION_METADATA_KEY", "PRIMARY_METADATA_KEY"]

SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name

# 1 MiB chunks measured fastest for gRPC Python streams on loopback (256 KiB:
# about half the throughput, 4 MiB and more: 30-40% less); see
# docs/benchmarks.md.
DEFAULT_CHUNK_BYTES = 1 << 20
# Upper bound of one message on both sides: room for the largest chunk a
# client may ask for plus headers, and a bound on what a peer can make us buffer.
MAX_MESSAGE_BYTES = 64 << 20
# Call metadata naming the worker process (PSClient.incarnation) an Exchange
# stream belongs to: the server bounds the streams of each one.
INCARNATION_METADATA_KEY = "wehub-ps-incarnation"
# Trailing metadata of a NOT_PRIMARY refusal: the address ('host:port') of the
# shard's primary as the refusing replica knows it (absent while none is known).
PRIMARY_METADATA_KEY = "wehub-ps-primary"


def method_path(method: str) -> str:
    """'/wehub_ps.v1.ParameterServer/Pull' for 'Pull'."""
    return f"/{SERVICE_NAME}/{method}"
