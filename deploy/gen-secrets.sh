#!/usr/bin/env bash
# Generate the TLS material and the auth token the kustomizations turn into
# Secrets (ps-tls, ps-client-tls, ps-token). Nothing here is ever committed:
# the output directory is git-ignored.
#
#   deploy/gen-secrets.sh                      # into deploy/base/secrets/
#   deploy/gen-secrets.sh --namespace team-a   # SANs for another namespace
#   deploy/gen-secrets.sh --replicas 4         # SANs for ps-0 .. ps-3
#   deploy/gen-secrets.sh --token-only --force # rotate the token, keep the certificates
#
# Writes, into OUT (default deploy/base/secrets):
#   ca.crt, ca.key          a private CA (keep ca.key safe: it can mint certificates)
#   server.crt, server.key  ps-server certificate, serverAuth; SANs: ps, every
#                           pod ps-<i>.ps for i < REPLICAS, and for every
#                           namespace NS: ps-<i>.ps.NS, ps-<i>.ps.NS.svc,
#                           ps-<i>.ps.NS.svc.cluster.local, ps.NS, ps.NS.svc,
#                           ps.NS.svc.cluster.local, *.ps.NS.svc,
#                           *.ps.NS.svc.cluster.local; localhost, 127.0.0.1
#   client.crt, client.key  worker certificate for mutual TLS, clientAuth
#   token                   32 random bytes, hex, no trailing newline
#
# Options:
#   --out DIR         output directory
#   --namespace NS    namespace for the cluster-local SANs; repeatable
#                     (default: wehub-ps wehub-ps-train wehub-ps-tfjob, the
#                     namespaces of deploy/overlays/*, deploy/jobset, deploy/tfjob)
#   --replicas N      number of ps-server pods to name (ps-0 .. ps-<N-1>);
#                     default: $WEHUB_PS_REPLICAS, else the replicas of the
#                     StatefulSet in deploy/base/ps-statefulset.yaml
#   --days N          certificate validity in days (default 365)
#   --token-only      only (re)write the token
#   --force           overwrite existing files (default: refuse)
#
# Needs openssl 1.1.1 or newer.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$here/base/secrets"
days=365
token_only=0
force=0
namespaces=()
replicas="${WEHUB_PS_REPLICAS:-}"

usage() { sed -n '2,34p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --namespace) namespaces+=("${2:?--namespace needs a name}"); shift 2 ;;
    --replicas) replicas="${2:?--replicas needs a number}"; shift 2 ;;
    --days) days="${2:?--days needs a number}"; shift 2 ;;
    --token-only) token_only=1; shift ;;
    --force) force=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gen-secrets.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ ${#namespaces[@]} -eq 0 ]; then
  namespaces=(wehub-ps wehub-ps-train wehub-ps-tfjob)
fi
if [ -z "$replicas" ] && [ "$token_only" = 0 ]; then
  # The StatefulSet's own `spec.replicas` line (two spaces in), so the names
  # follow the manifest; an overlay that scales it needs --replicas.
  statefulset="$here/base/ps-statefulset.yaml"
  replicas="$(sed -n 's/^  replicas: *\([0-9][0-9]*\) *$/\1/p' "$statefulset" 2>/dev/null | head -n 1)"
  if [ -z "$replicas" ]; then
    echo "gen-secrets.sh: no replicas in $statefulset; pass --replicas N" >&2
    exit 2
  fi
fi
if [ "$token_only" = 0 ]; then
  case "$replicas" in ''|*[!0-9]*) echo "gen-secrets.sh: --replicas must be a positive number, got $replicas" >&2; exit 2 ;; esac
  replicas=$((10#$replicas))  # decimal even with leading zeros
  [ "$replicas" -gt 0 ] || { echo "gen-secrets.sh: --replicas must be a positive number, got $replicas" >&2; exit 2; }
fi
case "$days" in ''|*[!0-9]*) echo "gen-secrets.sh: --days must be a number, got $days" >&2; exit 2 ;; esac
command -v openssl >/dev/null || { echo "gen-secrets.sh: openssl not found" >&2; exit 1; }

mkdir -p "$out"
umask 077

if [ "$token_only" = 1 ]; then
  files=(token)
else
  files=(ca.crt ca.key server.crt server.key client.crt client.key token)
fi
if [ "$force" = 0 ]; then
  for f in "${files[@]}"; do
    if [ -e "$out/$f" ]; then
      echo "gen-secrets.sh: $out/$f exists; pass --force to replace it" >&2
      exit 1
    fi
  done
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The token: written to a temporary file first, so a failure never leaves a
# half-written one behind.
openssl rand -hex 32 | tr -d '\n' > "$work/token"

if [ "$token_only" = 0 ]; then
  # Every pod by name: OpenSSL clients (curl, Python's ssl, Prometheus) match
  # a wildcard against one label and only with two labels after it, so
  # `*.ps` would never match ps-0.ps for them. The namespaced wildcards are
  # kept: they match (for OpenSSL too) exactly the pods of the headless
  # Service `ps` by their full names, such as the JobSet's train-ps-0-0.
  sans="DNS:ps"
  for ((i = 0; i < replicas; i++)); do
    sans="$sans,DNS:ps-$i.ps"
  done
  for ns in "${namespaces[@]}"; do
    sans="$sans,DNS:ps.$ns,DNS:ps.$ns.svc,DNS:ps.$ns.svc.cluster.local"
    for ((i = 0; i < replicas; i++)); do
      sans="$sans,DNS:ps-$i.ps.$ns,DNS:ps-$i.ps.$ns.svc,DNS:ps-$i.ps.$ns.svc.cluster.local"
    done
    sans="$sans,DNS:*.ps.$ns.svc,DNS:*.ps.$ns.svc.cluster.local"
  done
  sans="$sans,DNS:localhost,IP:127.0.0.1"

  newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

  newkey "$work/ca.key"
  openssl req -x509 -new -key "$work/ca.key" -sha256 -days "$days" \
    -subj "/CN=wehub-ps CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$work/ca.crt"

  # sign NAME CN EXTENSIONS: a key and a certificate signed by the CA.
  sign() {
    newkey "$work/$1.key"
    openssl req -new -key "$work/$1.key" -subj "/CN=$2" -out "$work/$1.csr"
    printf '%s\n' "$3" > "$work/$1.ext"
    openssl x509 -req -in "$work/$1.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
      -CAcreateserial -sha256 -days "$days" -extfile "$work/$1.ext" -out "$work/$1.crt" 2>/dev/null
  }
  sign server ps "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$sans"
  sign client wehub-ps-worker "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  openssl verify -CAfile "$work/ca.crt" "$work/server.crt" "$work/client.crt" >/dev/null
fi

for f in "${files[@]}"; do
  # Readable by the owner only here; kustomize copies the bytes into Secrets.
  mv -f "$work/$f" "$out/$f"
done
echo "gen-secrets.sh: wrote ${files[*]} into $out" >&2
