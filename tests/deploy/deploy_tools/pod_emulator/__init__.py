"""Run the rendered manifests' pods as local processes: the runtime half of
the manifest/program contract (tests/deploy/test_contract.py).

From a render (a list of objects) this builds, for one pod of a StatefulSet or
an indexed Job, what the kubelet would give its container, and nothing else:

* the command and args exactly as rendered (``$(VAR)`` expanded as Kubernetes
  does), the executable looked up in the bin directory of this Python (the
  venv's console scripts ``ps-server`` / ``ps-worker``), or, for a third-party
  image's program (etcd), this machine's installed binary;
* the environment: ``envFrom`` ConfigMaps/Secrets, ``env`` values,
  ``configMapKeyRef``, ``secretKeyRef`` (base64 of the rendered Secret, names
  with their kustomize hash suffixes), ``fieldRef`` (name, namespace, labels
  and annotations the controller adds: ``apps.kubernetes.io/pod-index``,
  ``batch.kubernetes.io/job-completion-index``, pod IP, ...), plus what the
  Job controller and the image add (``JOB_COMPLETION_INDEX``, the image's
  ``ENV`` lines);
* the volumes: a Secret / ConfigMap volume becomes a directory of files written
  from the rendered object (``items``, ``defaultMode`` and the fsGroup
  ownership rules of the kubelet), a claim and an ``emptyDir`` become empty
  directories; every value in args/env that is a path under a ``mountPath``
  is rewritten to the directory standing in for that mount;
* the user: when we are root and ``setpriv`` works, the process runs as the
  securityContext's runAsUser / runAsGroup with fsGroup and
  supplementalGroups, no new privileges, an empty capability bounding set.

Anything the emulator cannot emulate faithfully (a volume type, a subPath, a
fieldRef it does not know) raises :class:`errors.HarnessError` rather than
guessing. Contract violations found while running (a process that dies at
start, a probe that never turns SERVING, a checkpoint that never reaches its
volume) raise :class:`errors.ContractError` naming the pod and quoting its log.

The modules, in the order a pod goes through them: ``workloads`` (which object
and container run a program), ``pod_environment`` and ``pod_volumes`` (what the
kubelet gives the container), ``pod_plan`` (the pod, ready to start),
``cluster_dns`` (names as cluster DNS answers them), ``processes`` (start, stop,
wait), ``probes`` (checks from outside: gRPC and httpGet probes, metrics, the
ports a pod listens on), and ``netns``, whose :class:`netns.PodNetwork` gives
every pod its own network namespace (veth pairs on a bridge, an address per pod,
hosts files as Kubernetes DNS would answer) for the "separate hosts" runs;
``replicated`` plans the replicated overlay's etcd members, shard replicas and
a worker on such a network, asks which replica is a shard's primary, and
recreates a StatefulSet pod on another host with an empty volume, as its
controller does once the pod of a lost node is force-deleted.
"""
