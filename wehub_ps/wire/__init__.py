"""The wire contract in code: message framing without copies, dtype codes, casts
to narrower wire dtypes, and the service's names and transport settings. The
generated stubs themselves live in ``wehub_ps.v1``, a path fixed by the
proto file's name (protos/wehub_ps/v1/ps.proto).
"""
