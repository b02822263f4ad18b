#!/usr/bin/env bash
# The image compose/Dockerfile builds FROM. No registry is reachable, so dsec makes it: a minimal
# Debian from debootstrap with the packages the services need, turned into an image by `docker import`.
# Both the rootfs tarball and the image are cached, keyed on suite, mirror and package list.
#   bash compose/base-image.sh          print the image name, building what is missing
#   bash compose/base-image.sh tarball  only make the cached tarball (no Docker engine needed)
set -euo pipefail
suite="${DSEC_BASE_SUITE:-bookworm}"
mirror="${DSEC_BASE_MIRROR:-http://deb.debian.org/debian}"
cache="${DSEC_CACHE_DIR:-/var/cache/dsec}"
# What the services run: python for all, containerd/runc/erofs/fuse/nftables for the host agent,
# gcc + libc6-dev to build the in-sandbox agent, busybox-static for the base template.
pkgs="python3,python3-venv,ca-certificates,containerd,runc,erofs-utils,fuse3,busybox-static,iproute2,nftables,e2fsprogs,util-linux,kmod,gcc,libc6-dev"
key="$(printf '%s\n%s\n%s\n' "$suite" "$mirror" "$pkgs" | sha256sum | cut -c1-12)"
image="dsec-base:$key"
tarball="$cache/dsec-base-$suite-$key.tar"

make_tarball() {
  [ -f "$tarball" ] && return 0
  mkdir -p "$cache"
  local root
  root="$(mktemp -d "$cache/rootfs.XXXXXX")"
  trap 'rm -rf "$root"' RETURN
  echo "dsec: debootstrap $suite into $root (cached as $tarball)" >&2
  debootstrap --variant=minbase --include="$pkgs" "$suite" "$root" "$mirror" >&2
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
}

make_tarball
if [ "${1:-}" = tarball ]; then echo "$tarball"; exit 0; fi
if ! docker image inspect "$image" >/dev/null 2>&1; then
  echo "dsec: docker import $tarball as $image" >&2
  docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' "$tarball" "$image" >/dev/null
fi
docker tag "$image" "dsec-base:$suite"
echo "$image"
