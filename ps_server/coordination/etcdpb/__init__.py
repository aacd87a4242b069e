"""Generated stubs for the part of etcd's v3 API that ps_server.coordination uses.

From protos/ps_server/coordination/etcdpb/etcd.proto; regenerate with the
command in README.md ("Regenerate the stubs").
"""
