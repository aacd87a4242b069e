"""Tools the deployment tests use, not tests themselves.

``manifests`` renders deploy/ and checks what it holds as data; ``pod_emulator``
runs a render's pods as local processes; ``availability`` skips a test module
whose tool is not installed. Modules that need an optional tool (PyYAML, the
gRPC health stubs) import it at import time, so a test module calls
``availability.require`` before it imports them.
"""
