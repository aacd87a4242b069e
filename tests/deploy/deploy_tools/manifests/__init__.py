"""Checks on the deployment manifests under deploy/.

Every check is a plain function that takes parsed objects (or files) and
returns the problems it found as human-readable strings, so the tests can
feed each one a deliberately broken input and see it complain. Nothing here
needs a cluster: manifests are rendered with the pinned ``kubectl kustomize``
(``kustomize``) and inspected as data.
"""
