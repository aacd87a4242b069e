"""Tools the deployment tests use, not tests themselves.

``availability`` skips a test module whose tool is not installed.
"""
