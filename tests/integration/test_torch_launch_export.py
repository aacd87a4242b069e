"""A PyTorch user's whole path: one script, run by `ps-local --script` on 2 workers, exported, served from
plain torch with no ps-server, its predictions those of the training cluster."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("torch")
from ps_testing import ROOT, child_env  # noqa: E402

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from worker_client import SGD, PSClient
    from worker_client.torch import PSEmbedding, PSEmbeddingBag, attach

    out, index, count = sys.argv[1], int(os.environ["PS_WORKER_INDEX"]), int(os.environ["PS_NUM_WORKERS"])
    torch.manual_seed(0)

    class Recommender(torch.nn.Module):
        def __init__(self, client):
            super().__init__()
            self.users = PSEmbedding(client, "users", 8)                      # a hash table: ids up to 2^40
            self.history = PSEmbeddingBag(client, "items", 8, num_embeddings=50, mode="mean", padding_idx=0)
            self.head = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def forward(self, users, history):
            return self.head(torch.cat([self.users(users), self.history(history)], dim=1)).squeeze(-1)

    def data(seed, n, user_ids):
        rng = np.random.default_rng(seed)
        users = rng.choice(user_ids, n)
        history = rng.integers(0, 50, (n, 4))
        history[rng.random((n, 4)) < 0.2] = 0  # padding
        labels = ((users % 7 < 3) ^ (history[:, 0] % 2 == 0)).astype(np.float32)
        return torch.from_numpy(users), torch.from_numpy(history), torch.from_numpy(labels)

    known = (np.arange(200, dtype=np.int64) * 7919) << 20  # large, sparse ids
    with PSClient.from_env() as client:
        model = Recommender(client)
        ps_model = attach(client, model, prefix="rec", optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1))
        users, history, labels = data(index, 2048, known)
        for epoch in range(3):
            for start in range(0, len(users), 128):
                with ps_model.step():
                    logits = model(users[start:start + 128], history[start:start + 128])
                    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[start:start + 128]).backward()
        client.create_variable("done", (1,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"done": np.array([-1.0], np.float32)})  # one more worker finished
        if index != 0:
            sys.exit(0)
        while client.pull(["done"])["done"][0] < count:
            time.sleep(0.05)
        # Held-out data: known users and users the tables never saw.
        unseen = np.array([2**40 + 5, 123456789, -3], np.int64)
        held_users, held_history, _ = data(99, 256, np.concatenate([known, unseen]))
        ps_model.pull()  # the parameters as the servers hold them, every push applied
        model.eval()
        rows_before = sum(i.variables["users"]["num_rows"] for i in client.describe())
        with torch.no_grad():
            served = model(held_users, held_history).numpy()
        assert sum(i.variables["users"]["num_rows"] for i in client.describe()) == rows_before
        state = ps_model.state_dict()
        save_file(state, os.path.join(out, "model.safetensors"))
        plain = ps_model.plain_model(state).eval()
    # The client is closed: the plain model cannot reach a server, and needs none.
    assert not any(hasattr(m, "client") for m in plain.modules())
    with torch.no_grad():
        exported = plain(held_users, held_history).numpy()
    np.save(os.path.join(out, "served.npy"), served)
    np.save(os.path.join(out, "exported.npy"), exported)
    np.save(os.path.join(out, "held_users.npy"), held_users.numpy())
    print("largest difference", float(np.abs(served - exported).max()))
""")


def test_a_script_trained_on_two_workers_exports_and_serves_the_same_predictions(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, "-m", "ps_local", "--script", str(script), "--workers", "2",
                             "--servers", "2", "--", str(tmp_path)], capture_output=True, text=True,
                            cwd=str(ROOT), env=child_env(), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    served, exported = np.load(tmp_path / "served.npy"), np.load(tmp_path / "exported.npy")
    np.testing.assert_array_equal(exported, served)  # the same rows, the same torch functions
    assert np.isin(np.load(tmp_path / "held_users.npy"), [2**40 + 5, 123456789, -3]).any()
    from safetensors.numpy import load_file

    state = load_file(tmp_path / "model.safetensors")
    assert {"users.ids", "users.rows", "items.ids", "items.rows", "rec/head.0.weight"} <= set(state)
    assert state["items.rows"].shape == (50, 8) and state["users.ids"].dtype == np.int64
    assert len(state["users.ids"]) == len(state["users.rows"]) <= 200  # rows of trained users only
