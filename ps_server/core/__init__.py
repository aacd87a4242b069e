"""The shard's state and its rules, free of gRPC and protobuf: variables and hash
tables, optimizers and initializers, applying pushes and planning pulls, the
exactly-once ledger, sync/SSP consistency, worker membership, the apply gate,
admission limits and the server's lifecycle.
"""
