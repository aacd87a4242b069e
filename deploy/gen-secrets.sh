#!/usr/bin/env bash
# Generate the TLS material and the auth token the kustomizations turn into
# Secrets (ps-tls, ps-client-tls, ps-token). Nothing here is ever committed:
# the output directory is git-ignored.
#
#   deploy/gen-secrets.sh                      # into deploy/base/secrets/
#   deploy/gen-secrets.sh --namespace team-a   # SANs for another namespace
#   deploy/gen-secrets.sh --token-only --force # rotate the token, keep the certificates
#
# Writes, into OUT (default deploy/base/secrets):
#   ca.crt, ca.key          a private CA (keep ca.key safe: it can mint certificates)
#   server.crt, server.key  ps-server certificate, serverAuth; SANs: ps, *.ps,
#                           *.ps.<ns>.svc.cluster.local and ps.<ns>.svc.cluster.local
#                           for every namespace given, localhost, 127.0.0.1
#   client.crt, client.key  worker certificate for mutual TLS, clientAuth
#   token                   32 random bytes, hex, no trailing newline
#
# Options:
#   --out DIR         output directory
#   --namespace NS    namespace for the cluster-local SANs; repeatable
#                     (default: wehub-ps wehub-ps-train wehub-ps-tfjob, the
#                     namespaces of deploy/overlays/*, deploy/jobset, deploy/tfjob)
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

usage() { sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --namespace) namespaces+=("${2:?--namespace needs a name}"); shift 2 ;;
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
  sans="DNS:ps,DNS:*.ps"
  for ns in "${namespaces[@]}"; do
    sans="$sans,DNS:ps.$ns.svc.cluster.local,DNS:*.ps.$ns.svc.cluster.local,DNS:*.ps.$ns.svc"
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
