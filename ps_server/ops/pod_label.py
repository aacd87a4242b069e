"""The replica's role as a label on its own pod, so ``kubectl get pods -L wehub-ps/role`` shows the primary.

Each replica of a replicated shard patches the label ``wehub-ps/role`` of its
own pod through the Kubernetes API, with the pod's service account (as
Patroni labels its pods): ``primary``, ``backup`` (in sync: it applies the
primary's stream), ``joining`` (starting, catching up, campaigning, or a
deposed primary on its way to follow the new one). A replica that is
stopping removes the label: it no longer takes part. A process killed
outright leaves its last label until the next process in the pod sets one;
the label is a view for operators, the election (etcd) is the authority.

The patches run on their own thread (``ps-pod-label``): :meth:`PodRoleLabel.set`
never blocks and keeps only the newest wanted value, so memory stays
bounded however fast the role changes and a slow or absent API server never
holds the role's thread. Failures that may pass (connection, timeout, 5xx,
429) are retried with exponential backoff; an answer that retrying cannot
change (401, 403: the service account lacks the Role; 404: no such pod)
turns the label off for the process's life, logged once at WARNING with
the Role it needs. Outside a pod (no service account token) it is off and
says so at DEBUG only.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from wehub_ps.process.logs import Throttled, event

__all__ = ["ROLE_LABEL", "DEFAULT_SERVICE_ACCOUNT_DIR", "PodTarget", "PodRoleLabel", "label_value",
           "pod_target"]

log = logging.getLogger("ps_server.pod_label")

#: The label's key; its values are those of :func:`label_value`.
ROLE_LABEL = "wehub-ps/role"
#: Where the kubelet mounts a pod's service account token, CA and namespace.
DEFAULT_SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

#: What the service account needs, said in the WARNING that turns the label off.
NEEDED_ROLE = ("a Role granting patch on pods (resourceNames: this pod) bound to the pod's service "
               "account, and automountServiceAccountToken: true (deploy/overlays/replicated/rbac.yaml)")

# Answers that retrying cannot change, so the label is turned off: 401 (token refused), 403 (no Role),
# 404 (no pod of that name: POD_NAME wrong), 400, 415, 422 (a patch this API server does not take).
_PERMANENT = frozenset({400, 401, 403, 404, 415, 422})
# Bytes of an answer kept for the log; the rest (the whole pod object on success) is not read.
_ANSWER_BYTES = 2048

_retrying = Throttled(log, logging.WARNING, "cannot update the pod's role label; retrying", interval=60.0)


def label_value(state: str) -> str | None:
    """The label for a replica's role state (ps_server.replication.role); None removes the label.

    ``backup`` only once the backup follows its primary's stream in sync
    (its readiness is SERVING then); every other state of a replica that
    still takes part is ``joining``; ``stopping`` takes the label off.
    """
    if state in ("primary", "backup"):
        return state
    if state == "stopping":
        return None
    return "joining"


@dataclass(frozen=True)
class PodTarget:
    """Which pod to label, and the API server and credentials to do it with."""

    host: str
    port: int
    namespace: str
    pod: str
    token_file: str
    ca_file: str

    @property
    def path(self) -> str:
        quote = urllib.parse.quote
        return f"/api/v1/namespaces/{quote(self.namespace, safe='')}/pods/{quote(self.pod, safe='')}"


def pod_target(environ: Mapping[str, str], service_account_dir: str) -> tuple[PodTarget | None, str]:
    """This pod, from the in-cluster environment: (target, "") or (None, why it is not in a pod).

    The API server from ``KUBERNETES_SERVICE_HOST``/``_PORT`` (set by the
    kubelet), the pod from ``POD_NAME`` (downward API; else ``HOSTNAME``,
    which is the pod's name unless the pod spec sets ``hostname``), the
    namespace from ``POD_NAMESPACE`` or the service account's ``namespace``.
    """
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        return None, "KUBERNETES_SERVICE_HOST/PORT are not set: not in a Kubernetes pod"
    token_file = os.path.join(service_account_dir, "token")
    ca_file = os.path.join(service_account_dir, "ca.crt")
    for path in (token_file, ca_file):
        if not os.path.isfile(path):
            return None, f"{path} does not exist: the pod mounts no service account token"
    namespace = environ.get("POD_NAMESPACE", "")
    if not namespace:
        try:
            with open(os.path.join(service_account_dir, "namespace")) as f:
                namespace = f.read().strip()
        except OSError:
            pass
    pod = environ.get("POD_NAME") or environ.get("HOSTNAME", "")
    if not namespace or not pod:
        return None, "the pod's name or namespace is unknown (set POD_NAME and POD_NAMESPACE)"
    try:
        port_number = int(port)
    except ValueError:
        return None, f"KUBERNETES_SERVICE_PORT is not a port: {port!r}"
    return PodTarget(host, port_number, namespace, pod, token_file, ca_file), ""


_NOTHING = object()


class _Refused(Exception):
    """The API server's answer says retrying cannot help."""


class PodRoleLabel:
    """Keeps ``wehub-ps/role`` on one pod equal to the newest value given to :meth:`set`.

    Thread-safe. Delivery: the newest value is patched at least once while
    the API server answers, values replaced before their turn are skipped;
    after :meth:`stop` nothing more is sent.
    """

    def __init__(self, target: PodTarget, *, timeout: float = 5.0, first_retry: float = 0.5,
                 max_retry: float = 30.0) -> None:
        self.target = target
        self._timeout = timeout
        self._first_retry = first_retry
        self._max_retry = max_retry
        # Guards _wanted, _applied, _off and _stopping; the thread waits on it for a new value.
        self._cond = threading.Condition()
        self._wanted: object = _NOTHING  # the value to put on the pod (None: no label)
        self._applied: object = _NOTHING  # the last value the API server took (_NOTHING: none yet)
        self._off = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def off(self) -> bool:
        """True once an answer turned the label off (no permission, no such pod)."""
        return self._off

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ps-pod-label", daemon=True)
        self._thread.start()

    def set(self, value: str | None) -> None:
        """Want ``value`` (None: no label) on the pod; returns at once, a newer call replaces an older one."""
        with self._cond:
            self._wanted = value
            self._cond.notify_all()

    def stop(self, value: str | None = None, wait: float = 1.0) -> None:
        """Want ``value`` last and give the thread up to ``wait`` seconds to patch it, then stop it.

        Bounded so a stopping replica whose API server is away still stops
        in time; the label then keeps its previous value.
        """
        self.set(value)
        deadline = time.monotonic() + wait
        with self._cond:
            while (self._thread is not None and not self._off and self._applied != value
                   and time.monotonic() < deadline):
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - a bug here must not pass unseen, nor touch the replica
            log.exception("pod role label off: its thread failed", extra={"fields": {"pod": self.target.pod}})
            with self._cond:
                self._off = True
                self._cond.notify_all()

    def _loop(self) -> None:
        delay = self._first_retry
        failing = False
        while True:
            with self._cond:
                while not self._stopping and self._wanted in (_NOTHING, self._applied):
                    self._cond.wait()
                if self._stopping:
                    return
                value = self._wanted
            assert value is None or isinstance(value, str)
            try:
                self._patch(value)
            except _Refused as refused:
                with self._cond:
                    self._off = True
                    self._cond.notify_all()
                event(log, logging.WARNING, "pod role label off: the Kubernetes API refused the patch",
                      label=ROLE_LABEL, pod=self.target.pod, namespace=self.target.namespace,
                      answer=str(refused), needs=NEEDED_ROLE)
                return
            except (OSError, http.client.HTTPException, ssl.SSLError) as error:
                failing = True
                _retrying(pod=self.target.pod, error=str(error) or type(error).__name__,
                          retry_seconds=round(delay, 2))
                retry_at = time.monotonic() + delay * random.uniform(0.8, 1.2)
                with self._cond:  # back off, even when a new value comes; a stop ends the wait
                    while not self._stopping and time.monotonic() < retry_at:
                        self._cond.wait(retry_at - time.monotonic())
                delay = min(delay * 2, self._max_retry)
                continue
            if failing:
                event(log, logging.INFO, "pod role label updated again", pod=self.target.pod, role=value)
            else:
                event(log, logging.DEBUG, "pod role label updated", pod=self.target.pod, role=value)
            failing, delay = False, self._first_retry
            with self._cond:
                self._applied = value
                self._cond.notify_all()

    def _patch(self, value: str | None) -> None:
        """One JSON merge patch of the pod's labels (null removes the label); raises on failure."""
        target = self.target
        with open(target.token_file) as f:  # re-read each time: the kubelet rotates projected tokens
            token = f.read().strip()
        context = ssl.create_default_context(cafile=target.ca_file)
        body = json.dumps({"metadata": {"labels": {ROLE_LABEL: value}}}).encode()
        connection = http.client.HTTPSConnection(target.host, target.port, timeout=self._timeout,
                                                 context=context)
        try:
            connection.request("PATCH", target.path, body=body, headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json",
                "Accept": "application/json", "User-Agent": "wehub-ps/ps-server"})
            response = connection.getresponse()
            answer = response.read(_ANSWER_BYTES) if response.status >= 300 else b""
        except socket.timeout as error:
            raise OSError(f"no answer within {self._timeout:g} s") from error
        finally:
            connection.close()
        if response.status < 300:
            return
        text = f"{response.status} {_message(answer) or response.reason}"
        if response.status in _PERMANENT:
            raise _Refused(text)
        raise http.client.HTTPException(text)


def _message(answer: bytes) -> str:
    """The ``message`` of a Kubernetes Status answer, or its first bytes."""
    try:
        return str(json.loads(answer)["message"])
    except (ValueError, KeyError, TypeError):
        return answer.decode(errors="replace").strip()[:200]
