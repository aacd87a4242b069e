"""Tools the deployment tests use, not tests themselves.

``manifests`` renders deploy/ and checks what it holds as data;
``availability`` skips a test module whose tool is not installed. Modules that
need an optional tool (PyYAML) import it at import time, so a test module calls
``availability.require`` before it imports them.
"""
