"""Schema validation of a render: built-in kinds against kubernetes-validate's schemas,
the custom resources (JobSet, TFJob, cert-manager's Issuer and Certificate) against the fields
these manifests may use."""

from __future__ import annotations

import copy

from .k8s_objects import ref

#: Oldest Kubernetes release the manifests must validate against (StatefulSet
#: pod-index label: 1.28+; native gRPC probes: 1.27+).
K8S_MIN_VERSION = "1.33"

#: Custom resources the manifests may contain; everything else must be a
#: built-in kind that kubernetes-validate knows.
CRD_ALLOWLIST = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    ("kubeflow.org/v1", "TFJob"),
    # deploy/cert-manager: the certificates from cert-manager instead of gen-secrets.sh.
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
}

#: The fields of the custom resources that these manifests may use. The
#: operators' CRDs are far bigger; this pins what we rely on and catches typos
#: (unknown fields are pruned silently by the API server).
_JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object", "required": ["spec"],
                                         "properties": {"metadata": {"type": "object"},
                                                        "spec": {"type": "object"}},
                                         "additionalProperties": False},
                            "dependsOn": {"type": "array", "maxItems": 1, "items": {
                                "type": "object", "required": ["name", "status"], "additionalProperties": False,
                                "properties": {"name": {"type": "string"},
                                               "status": {"enum": ["Ready", "Complete"]}}}},
                        },
                    },
                },
                "network": {"type": "object", "additionalProperties": False, "properties": {
                    "enableDNSHostnames": {"type": "boolean"},
                    "subdomain": {"type": "string"},
                    "publishNotReadyAddresses": {"type": "boolean"}}},
                "successPolicy": {"type": "object", "required": ["operator"], "additionalProperties": False,
                                  "properties": {"operator": {"enum": ["All", "Any"]},
                                                 "targetReplicatedJobs": {"type": "array",
                                                                          "items": {"type": "string"}}}},
                "failurePolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "maxRestarts": {"type": "integer", "minimum": 0},
                    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["name", "action"], "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Za-z]([-A-Za-z0-9_]*[A-Za-z0-9])?$"},
                            "action": {"enum": ["FailJobSet", "RestartJobSet",
                                                "RestartJobSetAndIgnoreMaxRestarts"]},
                            "onJobFailureReasons": {"type": "array", "items": {"enum": [
                                "BackoffLimitExceeded", "DeadlineExceeded", "PodFailurePolicy",
                                "MaxFailedIndexesExceeded"]}},
                            "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}}}}}}},
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            },
        },
    },
}

_TF_REPLICA = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object", "required": ["spec"], "additionalProperties": False,
                     "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}},
    },
}

_TFJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "TFJob"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["tfReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "tfReplicaSpecs": {"type": "object", "minProperties": 1, "additionalProperties": False,
                                   "properties": {k: _TF_REPLICA for k in
                                                  ("PS", "Worker", "Chief", "Master", "Evaluator")}},
                "runPolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "cleanPodPolicy": {"enum": ["None", "All", "Running"]},
                    "ttlSecondsAfterFinished": {"type": "integer"},
                    "activeDeadlineSeconds": {"type": "integer"},
                    "backoffLimit": {"type": "integer"},
                    "schedulingPolicy": {"type": "object"},
                    "suspend": {"type": "boolean"},
                    "managedBy": {"type": "string"}}},
                "successPolicy": {"enum": ["", "AllWorkers"]},
                "enableDynamicWorker": {"type": "boolean"},
            },
        },
    },
}

_ISSUER_REF = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "minLength": 1},
    "kind": {"enum": ["Issuer", "ClusterIssuer"]},
    "group": {"const": "cert-manager.io"}}}

#: cert-manager's key usages (certificate.spec.usages), as its API validates them.
CERT_MANAGER_USAGES = ("signing", "digital signature", "content commitment", "key encipherment", "key agreement",
                       "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any",
                       "server auth", "client auth", "code signing", "email protection", "s/mime",
                       "ipsec end system", "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
                       "microsoft sgc", "netscape sgc")

_CERTIFICATE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "issuerRef": _ISSUER_REF,
                "commonName": {"type": "string", "maxLength": 64},
                "isCA": {"type": "boolean"},
                "duration": {"type": "string", "pattern": "^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"},
                "renewBefore": {"type": "string", "pattern": "^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"},
                "dnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "ipAddresses": {"type": "array", "items": {"type": "string"}},
                "usages": {"type": "array", "items": {"enum": list(CERT_MANAGER_USAGES)}},
                "privateKey": {"type": "object", "additionalProperties": False, "properties": {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": {"type": "integer"},
                    "encoding": {"enum": ["PKCS1", "PKCS8"]},
                    "rotationPolicy": {"enum": ["Never", "Always"]}}},
            },
        },
    },
}

_ISSUER_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
            "properties": {
                "selfSigned": {"type": "object", "additionalProperties": False},
                "ca": {"type": "object", "required": ["secretName"], "additionalProperties": False,
                       "properties": {"secretName": {"type": "string", "minLength": 1}}},
            },
        },
    },
}

CRD_SCHEMAS = {("jobset.x-k8s.io/v1alpha2", "JobSet"): _JOBSET_SCHEMA, ("kubeflow.org/v1", "TFJob"): _TFJOB_SCHEMA,
               ("cert-manager.io/v1", "Certificate"): _CERTIFICATE_SCHEMA,
               ("cert-manager.io/v1", "Issuer"): _ISSUER_SCHEMA}


def embedded_core_objects(obj: dict) -> list[tuple[str, dict]]:
    """The built-in objects a custom resource will make, as the operator would.

    JobSet: one batch/v1 Job per replicatedJob. TFJob: one v1 Pod per replica
    type (restartPolicy as the operator sets it from the replica spec).
    """
    meta = obj.get("metadata") or {}
    name, ns = meta.get("name"), meta.get("namespace")
    out = []
    if obj.get("kind") == "JobSet":
        for rjob in (obj.get("spec") or {}).get("replicatedJobs") or []:
            template = rjob.get("template") or {}
            job_meta = dict(template.get("metadata") or {})
            job_meta.update(name=f"{name}-{rjob.get('name')}-0", **({"namespace": ns} if ns else {}))
            out.append((f"{ref(obj)} replicatedJob {rjob.get('name')}",
                        {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta,
                         "spec": copy.deepcopy(template.get("spec") or {})}))
    elif obj.get("kind") == "TFJob":
        for rtype, rspec in ((obj.get("spec") or {}).get("tfReplicaSpecs") or {}).items():
            template = (rspec or {}).get("template") or {}
            pod_meta = dict(template.get("metadata") or {})
            pod_meta.update(name=f"{name}-{rtype.lower()}-0", **({"namespace": ns} if ns else {}))
            spec = copy.deepcopy(template.get("spec") or {})
            policy = (rspec or {}).get("restartPolicy")
            if policy and policy != "ExitCode":
                spec.setdefault("restartPolicy", policy)
            out.append((f"{ref(obj)} {rtype}", {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                                                 "spec": spec}))
    return out


def validation_problems(objects: list[dict], version: str = K8S_MIN_VERSION) -> list[str]:
    """kubernetes-validate in strict mode; a missing schema is a failure, not a warning."""
    import jsonschema
    import kubernetes_validate

    problems = []

    def core(where: str, obj: dict) -> None:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message} (not a built-in kind, and not in the CRD allowlist)")

    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in CRD_ALLOWLIST:
            for error in jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).iter_errors(obj):
                path = ".".join(str(p) for p in error.path)
                problems.append(f"{ref(obj)}: {path}: {error.message}")
            for where, embedded in embedded_core_objects(obj):
                core(where, embedded)
        else:
            core(ref(obj), obj)
    return problems


def crd_semantics_problems(objects: list[dict]) -> list[str]:
    """Names that refer to other parts of a custom resource must exist."""
    problems = []
    for obj in (o for o in objects if o.get("kind") == "JobSet"):
        spec = obj.get("spec") or {}
        names = [r.get("name") for r in spec.get("replicatedJobs") or []]
        targets = (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []
        for target in targets:
            if target not in names:
                problems.append(f"{ref(obj)}: successPolicy targets replicatedJob {target!r}, not one of {names}")
        for rjob in spec.get("replicatedJobs") or []:
            for dep in rjob.get("dependsOn") or []:
                if dep.get("name") not in names[:names.index(rjob.get("name"))]:
                    problems.append(f"{ref(obj)}: replicatedJob {rjob.get('name')} depends on "
                                    f"{dep.get('name')!r}, which is not an earlier replicatedJob")
    return problems
