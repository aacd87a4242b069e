"""A worker process running a built-in example: ``ps-worker``, and ps-local's workers.

Everything can come from the environment, so the same command runs under
ps-local, a Kubernetes indexed Job, a JobSet or a Kubeflow TFJob:

* addresses: ``--addresses`` or ``PS_ADDRESSES``, else TF_CONFIG's cluster.ps;
* worker index: ``--worker-index``, ``PS_WORKER_INDEX``, ``JOB_COMPLETION_INDEX``
  (indexed Jobs), else TF_CONFIG (the chief is 0, worker i is i+1 when there
  is a chief);
* number of workers: ``--num-workers``, ``PS_NUM_WORKERS``, else TF_CONFIG;
* TLS and token: ``PS_TLS_CA``, ``PS_TLS_CERT``, ``PS_TLS_KEY``,
  ``PS_SERVER_NAME``, ``PS_AUTH_TOKEN_FILE`` (see ``PSClient.from_env``);
* ``PS_LOG_LEVEL`` (default warning): JSON log lines on stderr;
* ``--finish-cluster`` / ``PS_FINISH_CLUSTER=1``: when training is done, worker 0
  waits for the others to leave and then makes every server write its final
  checkpoint and exit 0 (run-to-completion jobs).

Progress goes to stdout as JSON lines (``{"type": "progress", ...}``) for
ps-local to aggregate; errors go to stderr and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from ps_local.examples import EXAMPLES, load_example
from wehub_ps.cluster import (
    ADDRESSES_ENV,
    EXAMPLE_CONFIG_ENV,
    EXAMPLE_ENV,
    FINISH_CLUSTER_ENV,
    LOG_LEVEL_ENV,
    NUM_WORKERS_ENV,
    WIRE_DTYPE_ENV,
    WORKER_INDEX_ENV,
    ClusterConfigError,
    ps_addresses_from_env,
    task_from_tf_config,
)
from wehub_ps.process.logs import configure
from worker_client import PSClient


def _emit(kind: str, worker: int, payload: dict) -> None:
    print(json.dumps({"type": kind, "worker": worker, **payload}), flush=True)


def _first_int(*values: str | None) -> int | None:
    for value in values:
        if value not in (None, ""):
            return int(value)
    return None


def _resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[list[str], int, int]:
    """(addresses, worker index, number of workers) from flags, environment and TF_CONFIG."""
    task = task_from_tf_config(environ)
    addresses = args.addresses.split(",") if args.addresses else list(ps_addresses_from_env(environ))
    tf_index = None
    if task is not None and task.task_type in ("worker", "chief"):
        has_chief = "chief" in json.loads(environ["TF_CONFIG"]).get("cluster", {})
        tf_index = task.task_index + (1 if has_chief and task.task_type == "worker" else 0)
    index = _first_int(args.worker_index, environ.get(WORKER_INDEX_ENV), environ.get("JOB_COMPLETION_INDEX"),
                       None if tf_index is None else str(tf_index))
    count = _first_int(args.num_workers, environ.get(NUM_WORKERS_ENV),
                       None if task is None or not task.num_workers else str(task.num_workers))
    if index is None or count is None:
        raise ClusterConfigError("the worker index and count are unknown: pass --worker-index and --num-workers, "
                                 "or set PS_WORKER_INDEX (or JOB_COMPLETION_INDEX) and PS_NUM_WORKERS, or TF_CONFIG")
    if not 0 <= index < count:
        raise ClusterConfigError(f"worker index {index} is outside [0, {count})")
    return addresses, index, count


def main(argv: list[str] | None = None) -> int:
    environ = os.environ
    # JSON log lines on stderr: a worker that waits for a server says which and why.
    configure(environ.get(LOG_LEVEL_ENV, "warning"))
    parser = argparse.ArgumentParser(prog="ps-worker", description="Train a built-in example as one worker.")
    parser.add_argument("--example", default=environ.get(EXAMPLE_ENV, "digits"), choices=sorted(EXAMPLES))
    parser.add_argument("--addresses", default=None,
                        help="comma-separated host:port of the ps-servers, a shard's replicas joined by '|'")
    parser.add_argument("--worker-index", default=None)
    parser.add_argument("--num-workers", default=None)
    parser.add_argument("--config", default=environ.get(EXAMPLE_CONFIG_ENV, "{}"),
                        help="JSON object of example Config overrides")
    parser.add_argument("--wire-dtype", default=environ.get(WIRE_DTYPE_ENV, "float32"),
                        help="float32, or bfloat16/float16 on the wire")
    parser.add_argument("--topk-ratio", type=float, default=None,
                        help="send only this fraction of each gradient's rows (error feedback: the rest "
                             "goes with the next push)")
    parser.add_argument("--finish-cluster", action="store_true",
                        default=environ.get(FINISH_CLUSTER_ENV, "").lower() in ("1", "true", "yes"),
                        help="worker 0 ends the job: servers checkpoint and exit 0 once all workers are done")
    args = parser.parse_args(argv)
    try:
        addresses, index, count = _resolve(args, environ)
    except (ClusterConfigError, ValueError) as exc:
        print(f"ps-worker: {exc}", file=sys.stderr)
        return 2
    example = load_example(args.example)
    config = example.Config(**json.loads(args.config))
    wire = None if args.wire_dtype == "float32" else args.wire_dtype
    env = {**environ, ADDRESSES_ENV: ",".join(addresses)}
    with PSClient.from_env(env, worker_id=f"worker-{index}", wire_dtype=wire,
                           topk_ratio=args.topk_ratio) as client:
        example.setup(client, config)
        sent_as = "float32" if client.wire_dtype is None else str(client.wire_dtype)
        # What this client really sends.
        _emit("started", index, {"wire_dtype": sent_as, "topk_ratio": args.topk_ratio})
        example.train(client, index, count, config, lambda progress: _emit("progress", index, progress))
        if args.finish_cluster and index == 0:
            client.finish(wait_for_workers=True)
    _emit("done", index, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
