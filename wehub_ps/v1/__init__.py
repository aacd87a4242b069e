"""Generated protobuf and gRPC code for wehub_ps.v1 (from protos/; never edit by hand)."""
