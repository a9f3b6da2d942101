#!/usr/bin/env bash
# Create (or update) the SROS2 keystore of the car graph: one CA, and per enclave of the policy a
# key, a certificate and signed permissions. Usage:
#   scripts/create_keystore.sh KEYSTORE [POLICY]      (POLICY: security/policy.xml)
# Environment: ROS_DOMAIN_ID (the domain the permissions are for, default 0), VALID_DAYS
# (certificate lifetime in days, default 3650), KEYSTORE_TOOL=auto|sros2|openssl (default auto:
# `ros2 security` where it exists, else openssl), PYTHON (default python3).
# Run again after editing the policy: existing keys and certificates are kept, permissions are
# generated and signed again.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEYSTORE="${1:?usage: $0 KEYSTORE [POLICY]}"
POLICY="$(realpath "${2:-$ROOT/security/policy.xml}")"
DOMAIN="${ROS_DOMAIN_ID:-0}"
VALID_DAYS="${VALID_DAYS:-3650}"
TOOL="${KEYSTORE_TOOL:-auto}"
PYTHON="${PYTHON:-python3}"
# The generator runs from this checkout when it is one, else from the installed package.
if [[ -d "$ROOT/sps_driving" ]]; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
generate() { "$PYTHON" -m sps_driving.ros.security --domain "$DOMAIN" "$@"; }

if [[ "$TOOL" == auto ]]; then
  if command -v ros2 >/dev/null && ros2 security --help >/dev/null 2>&1; then TOOL=sros2; else TOOL=openssl; fi
fi

if [[ "$TOOL" == sros2 ]]; then
  # sros2 creates the keystore when it is missing, then an enclave and its permissions per
  # enclave of the policy (the domain comes from ROS_DOMAIN_ID there too).
  ROS_DOMAIN_ID="$DOMAIN" ros2 security generate_artifacts -k "$KEYSTORE" -p "$POLICY"
  echo "keystore $KEYSTORE (ros2 security), domain $DOMAIN"
  exit 0
fi
[[ "$TOOL" == openssl ]] || { echo "KEYSTORE_TOOL must be auto, sros2 or openssl" >&2; exit 2; }

# The layout `ros2 security create_keystore` makes: one CA serves as identity and permissions CA.
mkdir -p "$KEYSTORE/public" "$KEYSTORE/private" "$KEYSTORE/enclaves"
chmod 700 "$KEYSTORE/private"
KEYSTORE="$(realpath "$KEYSTORE")"
PUBLIC="$KEYSTORE/public" PRIVATE="$KEYSTORE/private" ENCLAVES="$KEYSTORE/enclaves"

new_key() {  # DDS Security's authentication plugin wants ECDSA on prime256v1
  (umask 077 && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1")
}
subject_config() {  # an openssl req config with CN=$1: -subj would split the enclave path at its slashes
  printf '[req]\nprompt = no\ndistinguished_name = dn\n[dn]\nCN = %s\n' "$1"
}
iso_date() { date -u -d "$1" +%Y-%m-%dT%H:%M:%S; }
sign() {  # S/MIME clear-signed text, as sros2 writes governance.p7s and permissions.p7s
  openssl smime -sign -text -in "$1" -out "$2" -signer "$PUBLIC/permissions_ca.cert.pem" -inkey "$PRIVATE/permissions_ca.key.pem"
}

if [[ ! -f "$PRIVATE/ca.key.pem" ]]; then
  new_key "$PRIVATE/ca.key.pem"
  openssl req -x509 -new -sha256 -days "$VALID_DAYS" -key "$PRIVATE/ca.key.pem" \
    -config <(subject_config "sps_driving keystore CA") \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:1" -out "$PUBLIC/ca.cert.pem"
fi
for role in identity_ca permissions_ca; do
  ln -sfn ca.cert.pem "$PUBLIC/$role.cert.pem"
  ln -sfn ca.key.pem "$PRIVATE/$role.key.pem"
done
generate governance > "$ENCLAVES/governance.xml"
sign "$ENCLAVES/governance.xml" "$ENCLAVES/governance.p7s"

for enclave in $(generate enclaves "$POLICY"); do
  dir="$ENCLAVES/${enclave#/}"
  mkdir -p "$dir"
  ln -sfn "$(realpath -s --relative-to="$dir" "$PUBLIC/identity_ca.cert.pem")" "$dir/identity_ca.cert.pem"
  ln -sfn "$(realpath -s --relative-to="$dir" "$PUBLIC/permissions_ca.cert.pem")" "$dir/permissions_ca.cert.pem"
  ln -sfn "$(realpath -s --relative-to="$dir" "$ENCLAVES/governance.p7s")" "$dir/governance.p7s"
  if [[ ! -f "$dir/key.pem" || ! -f "$dir/cert.pem" ]]; then
    new_key "$dir/key.pem"
    openssl req -new -key "$dir/key.pem" -config <(subject_config "$enclave") |
      openssl x509 -req -sha256 -days "$VALID_DAYS" -CA "$PUBLIC/identity_ca.cert.pem" \
        -CAkey "$PRIVATE/identity_ca.key.pem" -set_serial "0x$(openssl rand -hex 16)" \
        -extfile <(printf 'basicConstraints=CA:FALSE\n') -out "$dir/cert.pem" 2>/dev/null
  fi
  # The permissions are valid exactly as long as the enclave's certificate.
  not_before="$(iso_date "$(openssl x509 -in "$dir/cert.pem" -noout -startdate | cut -d= -f2)")"
  not_after="$(iso_date "$(openssl x509 -in "$dir/cert.pem" -noout -enddate | cut -d= -f2)")"
  generate permissions "$POLICY" "$enclave" --not-before "$not_before" --not-after "$not_after" > "$dir/permissions.xml"
  sign "$dir/permissions.xml" "$dir/permissions.p7s"
done
echo "keystore $KEYSTORE (openssl), domain $DOMAIN: $(generate enclaves "$POLICY" | wc -l) enclaves"
