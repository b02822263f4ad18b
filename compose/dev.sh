#!/usr/bin/env bash
# One entry point for a fresh Debian machine (as root):
#   bash compose/dev.sh up     install what is missing, then run `dsec up` in the foreground
#   bash compose/dev.sh test   install what is missing, lint (ruff), type-check (mypy), then run the test suite
#   bash compose/dev.sh clean [DATA_DIR]   remove what a killed `dsec up` left (containers, containerd,
#                              shims, mounts, network); only while no `dsec up` runs on DATA_DIR
# Extra arguments go to `dsec up` or to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
venv="${DSEC_VENV:-$here/.venv}"
export HARBOR_VENV="${HARBOR_VENV:-$here/.venv-harbor}"  # tests/integration/test_harbor.py runs Harbor from here

debs=(containerd runc erofs-utils fuse3 busybox-static iproute2 nftables
      e2fsprogs util-linux gcc libc6-dev python3 python3-venv python3-dev debootstrap kmod
      docker.io docker-compose chromium  # the compose stack's engine, and the dashboard's browser tests
      docker-registry skopeo  # a real registry for the image-pull tests, and pushing to it
      qemu-system-x86 qemu-utils)  # the microvm backend (its guest kernel is fetched with apt-get download, not installed)

need_root() {
  if [ "$(id -u)" != 0 ]; then echo "dsec: run as root (containers need mounts, cgroups and namespaces)" >&2; exit 2; fi
}

install_debs() {
  local missing=()
  for p in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "dsec: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

install_criu() {
  bash "$here/compose/criu.sh"  # memory snapshots: a CRIU that runs on this kernel (built once)
}

install_python() {
  local py="${DSEC_PYTHON:-python3}"
  if [ ! -x "$venv/bin/python" ]; then
    echo "dsec: creating $venv"
    "$py" -m venv "$venv"
  fi
  local stamp="$venv/.dsec-installed"
  local want
  want="$(sha256sum pyproject.toml | cut -c1-16)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "dsec: installing the dsec package and its extras into $venv"
    "$venv/bin/pip" install -q --upgrade pip >/dev/null
    "$venv/bin/pip" install -q -e ".[dev,images]"
    # verl's SandboxFusion reward client, run unmodified by the FnCall tests: its module needs only
    # requests, while the package's own dependencies would pull torch (hence --no-deps)
    "$venv/bin/pip" install -q --no-deps verl
    echo "$want" > "$stamp"
  fi
}

install_harbor() {
  # Harbor (run unmodified against the gateway by tests/integration/test_harbor.py) needs Python >= 3.12,
  # so it has a venv of its own; without such a Python the test fails saying so
  local want="harbor[e2b]==0.26.0" py=""
  for c in "${DSEC_HARBOR_PYTHON:-}" /root/.pyenv/versions/3.12.1/bin/python3.12 python3.13 python3.12; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1; then py="$c"; break; fi
  done
  if [ -z "$py" ]; then echo "dsec: no Python >= 3.12 for Harbor (set DSEC_HARBOR_PYTHON); its test will fail" >&2; return 0; fi
  if [ "$(cat "$HARBOR_VENV/.dsec-installed" 2>/dev/null)" != "$want" ]; then
    echo "dsec: installing $want into $HARBOR_VENV"
    "$py" -m venv "$HARBOR_VENV"
    "$HARBOR_VENV/bin/pip" install -q "$want"
    echo "$want" > "$HARBOR_VENV/.dsec-installed"
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up)
    need_root; install_debs; install_criu; install_python
    exec "$venv/bin/dsec" up "$@"
    ;;
  test)
    need_root; install_debs; install_criu; install_python; install_harbor
    "$venv/bin/ruff" check .  # lint first: CI runs exactly this command
    "$venv/bin/mypy"  # the packages and strictness are pyproject.toml's [tool.mypy]
    exec "$venv/bin/python" -m pytest tests "$@"
    ;;
  install)
    need_root; install_debs; install_criu; install_python; install_harbor
    ;;
  clean)
    need_root; install_python
    exec "$venv/bin/python" -m hostagent --cleanup --data-dir "${1:-/var/lib/dsec}"
    ;;
  *)
    echo "usage: bash compose/dev.sh up|test|install|clean [args...]" >&2
    exit 2
    ;;
esac
