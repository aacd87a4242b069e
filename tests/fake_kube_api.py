"""A stand-in for the Kubernetes API server's pod PATCH, which cannot run here.

It serves HTTPS on loopback with a test CA, takes JSON merge patches of pods'
``metadata.labels`` at ``/api/v1/namespaces/<ns>/pods/<name>`` as the API
server does (a null value removes a label), keeps each pod's labels, records
every request, and can refuse (403 with a Kubernetes Status, as RBAC does),
fail (503) or hold its answers, so tests see what a replica's label thread
does with each. Only what ps_server/ops/pod_label.py uses is emulated.
"""

from __future__ import annotations

import json
import pathlib
import re
import ssl
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


@dataclass(frozen=True)
class Patch:
    """One request as the fake API server received it."""

    method: str
    path: str
    content_type: str
    authorization: str
    body: dict
    status: int
    at: float


class FakeKubeApi:
    """Pods' labels behind a PATCH endpoint; ``token`` is the only bearer token it accepts."""

    def __init__(self, cert: pathlib.Path, key: pathlib.Path, token: str = "sa-token", port: int = 0) -> None:
        self.token = token
        # Guards everything below: handler threads and the test read and write it.
        self._cond = threading.Condition()
        self.labels: dict[tuple[str, str], dict[str, str]] = {}
        self.requests: list[Patch] = []
        #: Pods (namespace, name) whose patches get 403, as without the Role's resourceNames.
        self.forbidden: set[tuple[str, str]] = set()
        #: Answers the next requests get first (503 etc.), whatever they are.
        self.failures: list[int] = []
        self._held = False
        #: Requests waiting for ``release``.
        self.waiting = 0
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._httpd.daemon_threads = True
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-kube-api", daemon=True)

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._httpd.shutdown()
        self._httpd.server_close()

    def hold(self) -> None:
        """Requests wait, unanswered, until ``release``."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def label(self, pod: str, key: str = "wehub-ps/role", namespace: str = "wehub-ps") -> str | None:
        with self._cond:
            return self.labels.get((namespace, pod), {}).get(key)

    def patches(self, pod: str | None = None) -> list[Patch]:
        with self._cond:
            return [r for r in self.requests if pod is None or r.path.endswith(f"/pods/{pod}")]

    def wait_for(self, condition, timeout: float = 10.0) -> None:
        """Until ``condition()`` holds after some request (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not condition():
                left = deadline - time.monotonic()
                assert left > 0, f"fake API server: not within {timeout}s; requests: {self.requests}"
                self._cond.wait(min(left, 0.1))

    def _answer(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
            while self._held:
                self._cond.wait()
            self.waiting -= 1
            status, answer = self._decide(method, path, headers, body)
            try:
                parsed = json.loads(body) if body else {}
            except ValueError:
                parsed = {"unparsed": body.decode(errors="replace")}
            self.requests.append(Patch(method, path, headers.get("Content-Type", ""),
                                       headers.get("Authorization", ""), parsed, status, time.monotonic()))
            self._cond.notify_all()
            return status, answer

    def _decide(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        """Under _cond: the answer, and the labels changed when it is 200."""
        if headers.get("Authorization") != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized")
        if self.failures:
            code = self.failures.pop(0)
            return code, _status(code, "injected failure")
        match = _POD_PATH.match(path)
        if method != "PATCH" or match is None:
            return 405, _status(405, f"{method} {path} is not emulated")
        pod = (match.group(1), match.group(2))
        if pod in self.forbidden:
            user = f"system:serviceaccount:{pod[0]}:ps"
            return 403, _status(403, f'pods "{pod[1]}" is forbidden: User "{user}" cannot patch resource '
                                     f'"pods" in API group "" in the namespace "{pod[0]}"')
        if headers.get("Content-Type") != "application/merge-patch+json":
            return 415, _status(415, "unsupported patch type")
        patch = json.loads(body)
        labels = self.labels.setdefault(pod, {})
        for key, value in ((patch.get("metadata") or {}).get("labels") or {}).items():
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
        return 200, {"kind": "Pod", "apiVersion": "v1",
                     "metadata": {"name": pod[1], "namespace": pod[0], "labels": dict(labels)}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:  # noqa: N802 - http.server's naming
                self._serve("PATCH")

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def _serve(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = api._answer(method, self.path, self.headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler


def _status(code: int, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


def service_account(directory: pathlib.Path, ca_cert: pathlib.Path, token: str = "sa-token",
                    namespace: str = "wehub-ps") -> pathlib.Path:
    """A directory laid out as the kubelet mounts a service account: token, ca.crt, namespace."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token + "\n")
    (directory / "ca.crt").write_bytes(ca_cert.read_bytes())
    (directory / "namespace").write_text(namespace)
    return directory
