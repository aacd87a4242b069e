"""What survives a restart: the checkpoint format (format), writing a
checkpoint (writer), choosing and loading one on start (restore, with
reshard for restoring onto another shard count), the checkpointer thread
(checkpointer), and the spec log that makes a new variable durable before
any checkpoint (spec_log).
"""
