"""deploy/cert-manager in place of deploy/gen-secrets.sh's certificates: every Secret a pod mounts
comes from a Certificate (or, where no Certificate can make it, from gen-secrets.sh: the token),
under the name the pods mount, with the keys they read; each Certificate chains through a CA
Issuer to a self-signed root, one CA per gen-secrets.sh CA; and each says what gen-secrets.sh
puts in its certificate (subject, names, key usages, key), read from that certificate with the
cryptography package."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .k8s_objects import find, find_secret, namespace_of, ref
from .pod_templates import PodUnit, command_of, pod_units
from .tls_material import _secret_bytes
from .wehub_wiring import secret_key_at

#: What gen-secrets.sh makes that no Certificate can: the bearer token (Secret ps-token).
GEN_SECRETS_ONLY = frozenset({"ps-token"})

#: A generated Secret's name: its kustomize name and a content hash.
_HASHED = re.compile(r"^(?P<name>.+)-[a-z0-9]{10}$")

#: cert-manager's usages as X.509 key usages (cryptography's KeyUsage attributes) and extended key usages.
_KEY_USAGES = {"digital signature": "digital_signature", "key encipherment": "key_encipherment",
               "cert sign": "key_cert_sign", "crl sign": "crl_sign", "content commitment": "content_commitment",
               "data encipherment": "data_encipherment", "key agreement": "key_agreement"}
_EXTENDED_USAGES = {"server auth": "1.3.6.1.5.5.7.3.1", "client auth": "1.3.6.1.5.5.7.3.2"}


def plain_name(name: str) -> str:
    """A Secret's name without kustomize's content hash."""
    match = _HASHED.match(name)
    return match.group("name") if match else name


@dataclass(frozen=True)
class SecretUse:
    """A pod template's use of a Secret: the whole Secret (key None) or one key of it."""

    where: str
    secret: str
    key: str | None


def secret_uses(unit: PodUnit) -> Iterator[SecretUse]:
    """The Secrets a pod template mounts or reads, and the keys its containers name: projected items,
    secretKeyRef, and every absolute path in a container's env values, command and args that lies
    on a Secret volume (ps-server's PS_TLS_*, etcd's --cert-file, ETCDCTL_CACERT, ...)."""
    for volume in unit.spec.get("volumes") or []:
        source = volume.get("secret")
        if source is not None:
            yield SecretUse(f"{unit.where} volume {volume.get('name')}", source.get("secretName"), None)
            for item in source.get("items") or []:
                yield SecretUse(f"{unit.where} volume {volume.get('name')}", source.get("secretName"), item.get("key"))
    for container in (unit.spec.get("initContainers") or []) + (unit.spec.get("containers") or []):
        where = f"{unit.where} container {container.get('name')}"
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                yield SecretUse(f"{where} envFrom", source["secretRef"].get("name"), None)
        for var in container.get("env") or []:
            selector = (var.get("valueFrom") or {}).get("secretKeyRef")
            if selector:
                yield SecretUse(f"{where} env {var.get('name')}", selector.get("name"), selector.get("key"))
        words = [str(v.get("value")) for v in container.get("env") or [] if "value" in v] + command_of(container)
        for word in words:
            for path in re.findall(r"(/[\w./-]+)", word):
                secret, key, problem = secret_key_at(unit, container, path)
                if not problem and key:
                    yield SecretUse(f"{where} ({path})", secret, key)


def certificate_writing(objects: list[dict], secret: str, namespace: str | None) -> dict | None:
    """The Certificate of the render whose Secret is ``secret``."""
    return next((o for o in objects if o.get("kind") == "Certificate" and namespace_of(o) == namespace
                 and (o.get("spec") or {}).get("secretName") == secret), None)


def secret_source_problems(objects: list[dict]) -> list[str]:
    """Every Secret a pod uses is written by a Certificate (and the keys read are a Certificate's
    tls.crt, tls.key, ca.crt), or is gen-secrets.sh's where no Certificate can make it."""
    problems = []
    for unit in pod_units(objects):
        for use in secret_uses(unit):
            cert = certificate_writing(objects, use.secret, unit.namespace)
            secret = find_secret(objects, use.secret, unit.namespace)
            if cert is None and plain_name(str(use.secret)) not in GEN_SECRETS_ONLY:
                problems.append(f"{use.where}: Secret {use.secret!r} comes from no Certificate"
                                + (" (the render holds gen-secrets.sh's, generated from its files)"
                                   if secret is not None else " and is not in the render"))
            elif secret is None:
                problems.append(f"{use.where}: Secret {use.secret!r} is not in the render")
            elif use.key is not None and use.key not in (secret.get("data") or {}) | (secret.get("stringData") or {}):
                problems.append(f"{use.where}: reads key {use.key!r} of Secret {use.secret!r}, which "
                                + (f"Certificate {cert['metadata']['name']} does not write" if cert else "lacks"))
    return problems


def issuer_of(objects: list[dict], cert: dict) -> dict | None:
    issuer_ref = (cert.get("spec") or {}).get("issuerRef") or {}
    if issuer_ref.get("kind", "Issuer") != "Issuer" or issuer_ref.get("group", "cert-manager.io") != "cert-manager.io":
        return None
    return find(objects, "Issuer", issuer_ref.get("name"), namespace_of(cert))


def ca_certificate(objects: list[dict], cert: dict) -> tuple[dict | None, str]:
    """The CA Certificate that signs ``cert`` (through a CA Issuer), or None and why not."""
    issuer = issuer_of(objects, cert)
    if issuer is None:
        return None, f"{ref(cert)}: issuerRef {cert['spec'].get('issuerRef')} names no Issuer of the render"
    ca_secret = ((issuer.get("spec") or {}).get("ca") or {}).get("secretName")
    if ca_secret is None:
        return None, f"{ref(cert)}: Issuer {issuer['metadata']['name']} is not a CA Issuer"
    ca = certificate_writing(objects, ca_secret, namespace_of(cert))
    if ca is None:
        return None, f"{ref(cert)}: the CA Issuer's Secret {ca_secret!r} is written by no Certificate"
    return ca, ""


def issuer_chain_problems(objects: list[dict]) -> list[str]:
    """Each Certificate that a pod's Secret comes from: signed by a CA Issuer whose CA is an isCA
    Certificate signed by a self-signed Issuer."""
    problems = []
    for cert in (o for o in objects if o.get("kind") == "Certificate" and not (o.get("spec") or {}).get("isCA")):
        ca, why = ca_certificate(objects, cert)
        if ca is None:
            problems.append(why)
            continue
        root = issuer_of(objects, ca)
        if not (ca.get("spec") or {}).get("isCA"):
            problems.append(f"{ref(cert)}: its CA {ref(ca)} is not isCA")
        if root is None or "selfSigned" not in (root.get("spec") or {}):
            problems.append(f"{ref(cert)}: its CA {ref(ca)} is not signed by a self-signed Issuer")
    return problems


def certificate_vs_pem_problems(cert: dict, pem: bytes) -> list[str]:
    """What ``cert`` (a Certificate) asks for against what gen-secrets.sh put in ``pem``: the common
    name, CA or not, the DNS and IP names, key usages and extended key usages, and an ECDSA P-256 key."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    made = x509.load_pem_x509_certificate(pem)
    spec = cert.get("spec") or {}
    where = ref(cert)
    problems = []
    names = made.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = names[0].value if names else None
    if spec.get("commonName") != common_name:
        problems.append(f"{where}: commonName {spec.get('commonName')!r}, gen-secrets.sh's is {common_name!r}")
    is_ca = made.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    if bool(spec.get("isCA")) != is_ca:
        problems.append(f"{where}: isCA {bool(spec.get('isCA'))}, gen-secrets.sh's certificate is "
                        f"{'a CA' if is_ca else 'no CA'}")
    try:
        alt = made.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = set(alt.get_values_for_type(x509.DNSName)), {str(i) for i in alt.get_values_for_type(x509.IPAddress)}
    except x509.ExtensionNotFound:
        dns, ips = set(), set()
    asked_ips = {str(ipaddress.ip_address(i)) for i in spec.get("ipAddresses") or []}
    for what, asked, have in (("dnsNames", set(spec.get("dnsNames") or []), dns), ("ipAddresses", asked_ips, ips)):
        if have - asked:
            problems.append(f"{where}: {what} lack {sorted(have - asked)}, which gen-secrets.sh's certificate has")
        if asked - have:
            problems.append(f"{where}: {what} add {sorted(asked - have)}, which gen-secrets.sh's certificate lacks")
    usages = set(spec.get("usages") or [])
    key_usage = made.extensions.get_extension_for_class(x509.KeyUsage).value
    have_ku = {u for u, attr in _KEY_USAGES.items() if getattr(key_usage, attr)}
    try:
        eku = made.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        have_eku = {u for u, oid in _EXTENDED_USAGES.items() if any(o.dotted_string == oid for o in eku)}
    except x509.ExtensionNotFound:
        have_eku = set()
    asked_usages = usages & (set(_KEY_USAGES) | set(_EXTENDED_USAGES))
    if asked_usages != have_ku | have_eku or usages - asked_usages:
        problems.append(f"{where}: usages {sorted(usages)}, gen-secrets.sh's certificate has "
                        f"{sorted(have_ku | have_eku)}")
    key = spec.get("privateKey") or {}
    public = made.public_key()
    if not (isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
            and key.get("algorithm") == "ECDSA" and key.get("size") == 256):
        problems.append(f"{where}: privateKey {key}, gen-secrets.sh's key is {type(public).__name__} "
                        f"{getattr(getattr(public, 'curve', None), 'name', '')}")
    return problems


def gen_secrets_match_problems(plain: list[dict], objects: list[dict]) -> list[str]:
    """For each Secret of the plain render (gen-secrets.sh's material) that a Certificate of
    ``objects`` (the render with deploy/cert-manager) replaces: the Certificate matches its tls.crt,
    its CA Certificate matches its ca.crt, and two Secrets share a CA Issuer exactly when
    gen-secrets.sh signed them with one CA."""
    problems = []
    issuers: dict[bytes, set[str]] = {}
    for secret in (o for o in plain if o.get("kind") == "Secret" and "tls.crt" in (o.get("data") or {})):
        name = plain_name(secret["metadata"]["name"])
        cert = certificate_writing(objects, name, namespace_of(secret))
        if cert is None:
            problems.append(f"Secret {name}: no Certificate writes it")
            continue
        problems += certificate_vs_pem_problems(cert, _secret_bytes(secret, "tls.crt"))
        ca, why = ca_certificate(objects, cert)
        if ca is None:
            problems.append(why)
            continue
        problems += certificate_vs_pem_problems(ca, _secret_bytes(secret, "ca.crt"))
        issuers.setdefault(_secret_bytes(secret, "ca.crt"), set()).add(cert["spec"]["issuerRef"]["name"])
    for names in issuers.values():
        if len(names) != 1:
            problems.append(f"Certificates signed by one gen-secrets.sh CA come from the Issuers {sorted(names)}")
    every = [n for names in issuers.values() for n in names]
    if len(every) != len(set(every)):
        problems.append(f"one Issuer signs for two of gen-secrets.sh's CAs: {sorted(every)} (etcd must not accept "
                        "a certificate of the ps-servers' and workers' CA)")
    return problems
