"""Code that both the ps-server daemon and the worker client need.

The wire contract (generated stubs in :mod:`wehub_ps.v1`), tensor framing,
variable specs, placement of variables on shards, cluster specs and error
reasons live here once, so the two sides can never drift apart. Nothing in
this package imports :mod:`ps_server` or :mod:`worker_client`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
