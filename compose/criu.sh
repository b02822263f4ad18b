#!/usr/bin/env bash
# Install a CRIU that works on this kernel, for memory snapshots (as root; called by dev.sh).
# Debian 12's criu 3.17 cannot dump anything on Linux >= 6.x here (it does not know the vDSO layout);
# 4.1.1 (Debian trixie's upstream tarball) does, with one patch for Linux 6.16+ socket options
# (hostagent/criu-sockopt-linux-6.16.patch says why). Built once, installed as /usr/local/sbin/criu.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
want="4.1.1"
sha="f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe"
dest="${DSEC_CRIU_DEST:-/usr/local/sbin/criu}"

if "$dest" --version 2>/dev/null | grep -q "Version: $want"; then
  exit 0
fi
echo "dsec: building CRIU $want into $dest (memory snapshots; a few minutes, once)"
export DEBIAN_FRONTEND=noninteractive
deps=(build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
      python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev
      libaio-dev xz-utils curl iproute2)
missing=()
for p in "${deps[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
work="$(mktemp -d /var/tmp/dsec-criu-XXXXXX)"
trap 'rm -rf "$work"' EXIT
tarball="$work/criu_${want}.orig.tar.xz"
# Debian's archive keeps the upstream tarball of every packaged version in its pool.
curl -fsSL --retry 3 -o "$tarball" "http://deb.debian.org/debian/pool/main/c/criu/criu_${want}.orig.tar.xz"
echo "$sha  $tarball" | sha256sum -c --quiet -
tar -C "$work" -xJf "$tarball"
cd "$work/criu-$want"
patch -p1 -s < "$here/hostagent/criu-sockopt-linux-6.16.patch"
make -s -j"$(nproc)" criu >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
install -m 0755 criu/criu "$dest"
"$dest" --version | head -1
