"""Replicated shards: one primary and its backups per shard, coordinated through etcd.

``role.py`` is a replica's state machine (follow, campaign, lead, step
down); ``log.py`` orders the primary's changes and tracks what each backup
acknowledged; ``leader.py`` serves a backup's Follow stream (a snapshot, then
every change); ``follower.py`` is the backup's side, which applies the
changes through ``records.py`` with the same code the primary ran.
"""
