"""The gRPC side of a shard: the ParameterServer servicer (parse a request, call
the core, frame the answer), authentication, and the standard health and
reflection services.
"""
