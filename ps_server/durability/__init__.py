"""What survives a restart: the checkpoint format, restore planning (including
restoring onto another shard count), the checkpointer thread, and the spec log
that makes a new variable durable before any checkpoint.
"""
