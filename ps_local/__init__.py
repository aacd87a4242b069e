"""ps-local: a whole wehub-ps cluster on one machine, training a built-in example.

Starts ``--num-ps`` ps-server processes and ``--num-workers`` worker
processes on loopback, shows live progress, evaluates the trained model on
held-out data and exits non-zero when training fails or misses its target.
The examples in :mod:`ps_local.examples` are templates for real jobs.
"""

__all__: list[str] = []
