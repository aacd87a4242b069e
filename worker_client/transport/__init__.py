"""How the client reaches servers: one channel per shard, the long-lived exchange
lane, the one fan-out to several shards, retries, credentials, and naming TLS
failures.
"""
