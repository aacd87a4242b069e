"""What synchronous mode applies for each ``aggregation``, exactly, on real ps-servers.

Three workers (one PSClient each, stepping in turn from this thread: a push
returns once merged into the open step, so one thread can play all three)
push known integer gradients, multiples of 6, with SGD(learning_rate=1)
from zeros: every mean of 1, 2 or 3 of them is exact in float32, and the
values are compared with the arithmetic bit for bit.

Per variable kind, the rows a step touches (w0, w1, w2 = the workers):

- a hash table: row A by w0 (6) and w1 (12), row B by w0 only (12), row D
  by w2 only (6), all on shard 0; row C by w1 (6) and w2 (18) on shard 1,
  where w0 sends no rows at all;
- a dense table (rows via push_rows): row 1 by w0 (6) and w1 (12), row 2
  by w0 (12), row 3 by w1 (6) and w2 (18), row 4 by w2 (6);
- a small dense variable pushed whole by w0 (6) and w1 (18), not by w2.

"sum" applies the sums; "mean" divides a part's row sums by the pushes of
the step that carried rows of that variable to that shard (3 on shard 0,
2 on shard 1) and a dense sum by the pushes that carried it (2);
"row_mean" divides each row's sum by the pushes that carried that row.
"""

from __future__ import annotations

import signal

import grpc
import numpy as np
import pytest

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.placement import hash_shards
from wehub_ps.specs import VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, SpecError, VariableConflictError

AGGREGATIONS = ("mean", "sum", "row_mean")
WORKERS = ("w0", "w1", "w2")
WAIT = 120.0  # generous bound for things that must happen


def _ids_on(shard: int, count: int, start: int = 1000) -> list[int]:
    """The first ``count`` hash-table ids from ``start`` that live on ``shard`` of 2."""
    candidates = np.arange(start, start + 200, dtype=np.int64)
    return candidates[hash_shards(candidates, 2) == shard][:count].tolist()


A, B, D = _ids_on(0, 3)
(C,) = _ids_on(1, 1)

#: Per worker: hash-table rows {id: gradient}, dense-table rows {row: gradient}, whole dense gradient.
TABLE_ROWS = {"w0": {A: 6, B: 12}, "w1": {A: 12, C: 6}, "w2": {D: 6, C: 18}}
DENSE_ROWS = {"w0": {1: 6, 2: 12}, "w1": {1: 12, 3: 6}, "w2": {3: 18, 4: 6}}
WHOLE = {"w0": 6, "w1": 18}

#: What one step applies (the SGD update is minus this), per aggregation, for two shards.
PER_STEP_2_SHARDS = {
    "sum": {"table": {A: 18, B: 12, C: 24, D: 6}, "rows": {1: 18, 2: 12, 3: 24, 4: 6}, "whole": 24},
    "mean": {"table": {A: 6, B: 4, C: 12, D: 2}, "rows": {1: 6, 2: 4, 3: 8, 4: 2}, "whole": 12},
    "row_mean": {"table": {A: 9, B: 12, C: 12, D: 6}, "rows": {1: 9, 2: 12, 3: 12, 4: 6}, "whole": 12},
}


def _create(client: PSClient) -> None:
    for aggregation in AGGREGATIONS:
        sgd = SGD(learning_rate=1.0)
        client.create_embedding(f"table_{aggregation}", 2, initializer="zeros", optimizer=sgd,
                                aggregation=aggregation)
        client.create_variable(f"rows_{aggregation}", (8, 2), optimizer=sgd, aggregation=aggregation)
        client.create_variable(f"whole_{aggregation}", (4,), optimizer=sgd, aggregation=aggregation)


def _push(step, worker: str) -> None:
    """``worker``'s gradients of a step, the same for every aggregation."""
    def rows(table: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        return (np.array(list(table), np.int64),
                np.repeat(np.array(list(table.values()), np.float32)[:, None], 2, axis=1))

    gradients, row_gradients = {}, {}
    for aggregation in AGGREGATIONS:
        row_gradients[f"table_{aggregation}"] = rows(TABLE_ROWS[worker])
        row_gradients[f"rows_{aggregation}"] = rows(DENSE_ROWS[worker])
        if worker in WHOLE:
            gradients[f"whole_{aggregation}"] = np.full(4, WHOLE[worker], np.float32)
    step.push(gradients, rows=row_gradients)


def _step(client: PSClient, worker: str) -> None:
    with client.step([]) as step:
        _push(step, worker)


def _check(observer: PSClient, per_step: dict[str, dict], steps: int) -> None:
    for aggregation, applied in per_step.items():
        ids = list(applied["table"])
        expected_table = np.array([[-steps * applied["table"][i]] * 2 for i in ids], np.float32)
        table = observer.pull_rows(f"table_{aggregation}", ids)
        assert table.tobytes() == expected_table.tobytes(), (aggregation, table, expected_table)
        expected_rows = np.zeros((8, 2), np.float32)
        for row, value in applied["rows"].items():
            expected_rows[row] = -steps * value
        values = observer.pull([f"rows_{aggregation}", f"whole_{aggregation}"])
        assert values[f"rows_{aggregation}"].tobytes() == expected_rows.tobytes(), (aggregation, values)
        expected_whole = np.full(4, -steps * applied["whole"], np.float32)
        assert values[f"whole_{aggregation}"].tobytes() == expected_whole.tobytes(), (aggregation, values)


def test_sum_mean_and_row_mean_of_rows_some_workers_pushed(cluster_factory):
    assert {hash_shards(np.array([i]), 2)[0] for i in (A, B, D)} == {0} and hash_shards(np.array([C]), 2)[0] == 1
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "3")
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    workers = {name: PSClient(cluster.addresses, worker_id=name, retry_timeout=WAIT) for name in WORKERS}
    try:
        _create(observer)
        steps = 2
        for _ in range(steps):
            for name, client in workers.items():
                _step(client, name)
        with workers["w0"].step([]):  # its pull waits until the last step is applied
            pass
        _check(observer, PER_STEP_2_SHARDS, steps)
        for shard in observer.describe():
            assert (shard.consistency["steps_applied"], shard.consistency["dropped_gradients"]) == (steps, 0)
    finally:
        for client in (*workers.values(), observer):
            client.close()


def test_aggregation_is_part_of_the_spec(cluster2):
    with PSClient(cluster2.addresses, worker_id="chief", register=False) as client:
        client.create_embedding("t", 2, aggregation="row_mean")
        client.create_variable("v", (4,), aggregation="row_mean")
        assert client.create_embedding("t", 2, aggregation="row_mean").spec.aggregation == "row_mean"
        with pytest.raises(VariableConflictError, match="aggregation 'row_mean' != 'mean'"):
            client.create_embedding("t", 2, aggregation="mean")
        with pytest.raises(VariableConflictError, match="aggregation 'row_mean' != 'sum'"):
            client.create_variable("v", (4,), aggregation="sum")
    with PSClient(cluster2.addresses, worker_id="reader", register=False) as reader:  # specs from the servers
        assert {name: v.spec.aggregation for name, v in reader.variables().items()} == {"t": "row_mean",
                                                                                       "v": "row_mean"}


def test_an_unknown_aggregation_is_refused_and_creates_nothing(cluster2):
    with PSClient(cluster2.addresses, worker_id="chief", register=False) as client:
        with pytest.raises(SpecError, match="aggregation of 'v' must be 'mean', 'sum' or 'row_mean', got 'avg'"):
            client.create_variable("v", (4,), aggregation="avg")
        with pytest.raises(SpecError, match="got 'per_row'"):
            client.create_embedding("t", 2, aggregation="per_row")
        # A client that sends an aggregation this server does not know: INVALID_ARGUMENT, INVALID_SPEC.
        spec = spec_to_proto(VariableSpec("raw", (4,), "float32"))
        spec.aggregation = 7
        request = ps_pb2.CreateVariableRequest(spec=spec, shard_index=0, num_shards=2)
        with grpc.insecure_channel(cluster2.addresses[0]) as channel, pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method_path("CreateVariable"))(request.SerializeToString(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(info.value.trailing_metadata())[REASON_METADATA_KEY] == "INVALID_SPEC"
        assert "unknown aggregation 7 (this version knows 'mean', 'sum', 'row_mean')" in info.value.details()
        assert all(not shard.variables for shard in client.describe())


#: One shard: every table row on it, so "mean" divides every row sum by the 3 pushes that sent rows.
PER_STEP_1_SHARD = {
    "sum": PER_STEP_2_SHARDS["sum"],
    "mean": {"table": {A: 6, B: 4, C: 8, D: 2}, "rows": {1: 6, 2: 4, 3: 8, 4: 2}, "whole": 12},
    "row_mean": PER_STEP_2_SHARDS["row_mean"],
}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_row_counts_of_an_open_step_survive_a_restart(cluster_factory, tmp_path, signum):
    """Step 1 is open with w0's and w1's pushes when the server stops; w2 pushes after the restart.

    The step's sums come back from the checkpoint with how many pushes carried
    each row, so all three aggregations still apply exactly what they would have.
    """
    cluster = cluster_factory(1, "--consistency", "sync", "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--checkpoint-interval", "0")
    server = cluster.servers[0]
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    workers = {name: PSClient(cluster.addresses, worker_id=name, retry_timeout=WAIT) for name in WORKERS}
    try:
        _create(observer)
        for name, client in workers.items():
            _step(client, name)
        _step(workers["w0"], "w0")
        _step(workers["w1"], "w1")
        last = workers["w2"].step([])
        last.__enter__()
        if signum == signal.SIGKILL:
            observer.checkpoint()  # a SIGKILL keeps what the last checkpoint holds
        server.signal(signum)
        assert server.wait(60) == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
        server.start(port=server.port)
        assert observer.describe()[0].consistency["step"] == 1
        _push(last, "w2")
        last.__exit__(None, None, None)
        with workers["w0"].step([]):  # its pull waits until step 1 is applied
            pass
        _check(observer, PER_STEP_1_SHARD, 2)
        state = observer.describe()[0].consistency
        assert (state["steps_applied"], state["dropped_gradients"]) == (2, 0)
    finally:
        for client in (*workers.values(), observer):
            client.close()
