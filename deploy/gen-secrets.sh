#!/usr/bin/env bash
# Generate the TLS material and the auth token the kustomizations turn into
# Secrets (ps-tls, ps-client-tls, ps-token; etcd-tls and etcd-client-tls for
# deploy/overlays/replicated). Nothing here is ever committed: the output
# directories are git-ignored.
#
#   deploy/gen-secrets.sh                      # into deploy/base/secrets/
#   deploy/gen-secrets.sh --namespace team-a   # SANs for another namespace
#   deploy/gen-secrets.sh --replicas 4         # SANs for ps-0 .. ps-3
#   deploy/gen-secrets.sh --shards 3 --shard-replicas 3
#                                              # replicated: ps-<s>-<r>, s < 3, r < 3
#   deploy/gen-secrets.sh --token-only --force # rotate the token, keep the certificates
#
# Writes, into OUT (default deploy/base/secrets):
#   ca.crt, ca.key          a private CA (keep ca.key safe: it can mint certificates)
#   server.crt, server.key  ps-server certificate, serverAuth and clientAuth
#                           (a backup presents it to its primary); SANs: ps,
#                           every pod ps-<i>.ps for i < REPLICAS, every
#                           replica pod ps-<s>-<r>.ps for s < SHARDS and
#                           r < SHARD_REPLICAS,
#                           and for every namespace NS: each pod's name +
#                           .NS, .NS.svc, .NS.svc.cluster.local, ps.NS, ps.NS.svc,
#                           ps.NS.svc.cluster.local, *.ps.NS.svc,
#                           *.ps.NS.svc.cluster.local, and the replicated
#                           TFJob's per-replica Services train-ps-<i>.NS,
#                           .NS.svc, .NS.svc.cluster.local for
#                           i < SHARDS x SHARD_REPLICAS; localhost, 127.0.0.1
#   client.crt, client.key  worker certificate for mutual TLS, clientAuth
#   token                   32 random bytes, hex, no trailing newline
#
# and, into ETCD_OUT (default deploy/overlays/replicated/secrets), etcd's own
# CA, so that etcd accepts no worker certificate:
#   etcd-ca.crt, etcd-ca.key          etcd's CA
#   etcd-server.crt, etcd-server.key  the members' certificate, serverAuth and
#                                     clientAuth (peers); SANs: etcd,
#                                     etcd-<i>.etcd for i < 3 and their
#                                     namespaced forms, *.etcd.NS.svc[.cluster.local],
#                                     localhost, 127.0.0.1
#   etcd-client.crt, etcd-client.key  the ps-servers' client certificate
#
# Options:
#   --out DIR         output directory
#   --namespace NS    namespace for the cluster-local SANs; repeatable
#                     (default: wehub-ps wehub-ps-train wehub-ps-tfjob, the
#                     namespaces of deploy/overlays/*, deploy/jobset, deploy/tfjob)
#   --replicas N      number of ps-server pods to name (ps-0 .. ps-<N-1>);
#                     default: $WEHUB_PS_REPLICAS, else the replicas of the
#                     StatefulSet in deploy/base/ps-statefulset.yaml
#   --shards S        replicated shards to name (ps-0-<r> .. ps-<S-1>-<r>, and
#                     the replicated TFJob's train-ps-<i> for i < S x R);
#                     default: $WEHUB_PS_SHARDS, else the number of shard-<i>/
#                     directories in deploy/overlays/replicated
#   --shard-replicas R  replicas per shard to name (ps-<s>-0 .. ps-<s>-<R-1>);
#                     default: $WEHUB_PS_SHARD_REPLICAS, else the replicas of the
#                     StatefulSet in deploy/overlays/replicated/shard/ps-statefulset.yaml
#   --etcd-out DIR    output directory of etcd's material
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
shards="${WEHUB_PS_SHARDS:-}"
shard_replicas="${WEHUB_PS_SHARD_REPLICAS:-}"
etcd_out="$here/overlays/replicated/secrets"
etcd_members=3

usage() { sed -n '2,61p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --namespace) namespaces+=("${2:?--namespace needs a name}"); shift 2 ;;
    --replicas) replicas="${2:?--replicas needs a number}"; shift 2 ;;
    --shards) shards="${2:?--shards needs a number}"; shift 2 ;;
    --shard-replicas) shard_replicas="${2:?--shard-replicas needs a number}"; shift 2 ;;
    --etcd-out) etcd_out="${2:?--etcd-out needs a directory}"; shift 2 ;;
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
if [ -z "$shards" ] && [ "$token_only" = 0 ]; then
  # One shard-<i>/ directory per shard of the replicated overlay; a shard
  # added there (deploy/README.md, "Replicated shards") is named on a rerun.
  shards=0
  while [ -d "$here/overlays/replicated/shard-$shards" ]; do
    shards=$((shards + 1))
  done
  if [ "$shards" = 0 ]; then
    echo "gen-secrets.sh: no shard-0/ in $here/overlays/replicated; pass --shards S" >&2
    exit 2
  fi
fi
if [ -z "$shard_replicas" ] && [ "$token_only" = 0 ]; then
  statefulset="$here/overlays/replicated/shard/ps-statefulset.yaml"
  shard_replicas="$(sed -n 's/^  replicas: *\([0-9][0-9]*\) *$/\1/p' "$statefulset" 2>/dev/null | head -n 1)"
  if [ -z "$shard_replicas" ]; then
    echo "gen-secrets.sh: no replicas in $statefulset; pass --shard-replicas R" >&2
    exit 2
  fi
fi
# positive NAME VALUE: VALUE as a decimal number > 0 (08 is eight), else exit 2.
positive() {
  case "$2" in ''|*[!0-9]*) echo "gen-secrets.sh: $1 must be a positive number, got $2" >&2; exit 2 ;; esac
  [ "$((10#$2))" -gt 0 ] || { echo "gen-secrets.sh: $1 must be a positive number, got $2" >&2; exit 2; }
}
if [ "$token_only" = 0 ]; then
  positive --replicas "$replicas"
  replicas=$((10#$replicas))
  positive --shards "$shards"
  shards=$((10#$shards))
  positive --shard-replicas "$shard_replicas"
  shard_replicas=$((10#$shard_replicas))
fi
case "$days" in ''|*[!0-9]*) echo "gen-secrets.sh: --days must be a number, got $days" >&2; exit 2 ;; esac
command -v openssl >/dev/null || { echo "gen-secrets.sh: openssl not found" >&2; exit 1; }

mkdir -p "$out"
[ "$token_only" = 1 ] || mkdir -p "$etcd_out"
umask 077

if [ "$token_only" = 1 ]; then
  files=(token)
else
  files=(ca.crt ca.key server.crt server.key client.crt client.key token)
  etcd_files=(etcd-ca.crt etcd-ca.key etcd-server.crt etcd-server.key etcd-client.crt etcd-client.key)
fi
if [ "$force" = 0 ]; then
  for f in "${files[@]}"; do
    if [ -e "$out/$f" ]; then
      echo "gen-secrets.sh: $out/$f exists; pass --force to replace it" >&2
      exit 1
    fi
  done
  for f in ${etcd_files[@]+"${etcd_files[@]}"}; do
    if [ -e "$etcd_out/$f" ]; then
      echo "gen-secrets.sh: $etcd_out/$f exists; pass --force to replace it" >&2
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
  # The pods: ps-<i> (one pod per shard) and ps-<s>-<r> (replica r of shard
  # s, deploy/overlays/replicated), whose short names a backup dials its
  # primary by (PS_ADVERTISE_ADDRESS) and verifies the certificate against.
  pods=()
  for ((i = 0; i < replicas; i++)); do
    pods+=("ps-$i")
  done
  for ((i = 0; i < shards; i++)); do
    for ((r = 0; r < shard_replicas; r++)); do
      pods+=("ps-$i-$r")
    done
  done
  sans="DNS:ps"
  for pod in "${pods[@]}"; do
    sans="$sans,DNS:$pod.ps"
  done
  for ns in "${namespaces[@]}"; do
    sans="$sans,DNS:ps.$ns,DNS:ps.$ns.svc,DNS:ps.$ns.svc.cluster.local"
    for pod in "${pods[@]}"; do
      sans="$sans,DNS:$pod.ps.$ns,DNS:$pod.ps.$ns.svc,DNS:$pod.ps.$ns.svc.cluster.local"
    done
    sans="$sans,DNS:*.ps.$ns.svc,DNS:*.ps.$ns.svc.cluster.local"
    # deploy/tfjob-replicated: the operator's headless Service of each PS
    # replica, train-ps-<i> (i < shards x replicas per shard), is the name a
    # replica advertises (its TF_CONFIG entry) and a backup verifies.
    for ((i = 0; i < shards * shard_replicas; i++)); do
      sans="$sans,DNS:train-ps-$i.$ns,DNS:train-ps-$i.$ns.svc,DNS:train-ps-$i.$ns.svc.cluster.local"
    done
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
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$sans"
  sign client wehub-ps-worker "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  openssl verify -CAfile "$work/ca.crt" "$work/server.crt" "$work/client.crt" >/dev/null

  # etcd: its own CA, the members' certificate, the ps-servers' client certificate.
  etcd_sans="DNS:etcd"
  for ((i = 0; i < etcd_members; i++)); do
    etcd_sans="$etcd_sans,DNS:etcd-$i.etcd"
  done
  for ns in "${namespaces[@]}"; do
    etcd_sans="$etcd_sans,DNS:etcd.$ns,DNS:etcd.$ns.svc,DNS:etcd.$ns.svc.cluster.local"
    for ((i = 0; i < etcd_members; i++)); do
      etcd_sans="$etcd_sans,DNS:etcd-$i.etcd.$ns,DNS:etcd-$i.etcd.$ns.svc,DNS:etcd-$i.etcd.$ns.svc.cluster.local"
    done
    etcd_sans="$etcd_sans,DNS:*.etcd.$ns.svc,DNS:*.etcd.$ns.svc.cluster.local"
  done
  etcd_sans="$etcd_sans,DNS:localhost,IP:127.0.0.1"
  newkey "$work/etcd-ca.key"
  openssl req -x509 -new -key "$work/etcd-ca.key" -sha256 -days "$days" \
    -subj "/CN=wehub-ps etcd CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$work/etcd-ca.crt"
  sign_etcd() {
    newkey "$work/$1.key"
    openssl req -new -key "$work/$1.key" -subj "/CN=$2" -out "$work/$1.csr"
    printf '%s\n' "$3" > "$work/$1.ext"
    openssl x509 -req -in "$work/$1.csr" -CA "$work/etcd-ca.crt" -CAkey "$work/etcd-ca.key" \
      -CAcreateserial -sha256 -days "$days" -extfile "$work/$1.ext" -out "$work/$1.crt" 2>/dev/null
  }
  sign_etcd etcd-server etcd "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$etcd_sans"
  sign_etcd etcd-client wehub-ps-server "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  openssl verify -CAfile "$work/etcd-ca.crt" "$work/etcd-server.crt" "$work/etcd-client.crt" >/dev/null
fi

for f in "${files[@]}"; do
  # Readable by the owner only here; kustomize copies the bytes into Secrets.
  mv -f "$work/$f" "$out/$f"
done
echo "gen-secrets.sh: wrote ${files[*]} into $out" >&2
if [ "$token_only" = 0 ]; then
  for f in "${etcd_files[@]}"; do
    mv -f "$work/$f" "$etcd_out/$f"
  done
  echo "gen-secrets.sh: wrote ${etcd_files[*]} into $etcd_out" >&2
fi
