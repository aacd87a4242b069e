"""One worker process of ps-local: runs an example's training loop.

Progress goes to stdout as JSON lines (``{"type": "progress", ...}``) for
the parent to aggregate; errors go to stderr and the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys

from ps_local.examples import load_example
from worker_client import PSClient


def _emit(kind: str, worker: int, payload: dict) -> None:
    print(json.dumps({"type": kind, "worker": worker, **payload}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ps_local.worker")
    parser.add_argument("--example", required=True)
    parser.add_argument("--addresses", required=True, help="comma-separated host:port of the ps-servers")
    parser.add_argument("--worker-index", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--config", default="{}", help="JSON object of example Config overrides")
    parser.add_argument("--wire-dtype", default="float32", help="float32, or bfloat16/float16 on the wire")
    args = parser.parse_args(argv)
    example = load_example(args.example)
    config = example.Config(**json.loads(args.config))
    wire = None if args.wire_dtype == "float32" else args.wire_dtype
    with PSClient(args.addresses.split(","), worker_id=f"worker-{args.worker_index}", wire_dtype=wire) as client:
        example.setup(client, config)
        _emit("started", args.worker_index, {})
        example.train(client, args.worker_index, args.num_workers, config,
                      lambda progress: _emit("progress", args.worker_index, progress))
    _emit("done", args.worker_index, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
