#!/usr/bin/env bash
# The compose dev stack (compose/docker-compose.yml) on this machine's Docker engine:
#   bash compose/stack.sh build   base image (debootstrap, cached), Python wheels (cached), dsec:dev
#   bash compose/stack.sh up      build, then start the stack in the background and wait until a host is ready
#   bash compose/stack.sh down    stop it and remove its containers, network and volumes
# DSEC_COMPOSE_PROJECT names the stack (default dsec); DSEC_NATS_PORT / DSEC_HTTP_PORT are the ports
# published on 127.0.0.1 (default 4222 / 3000). The engine must run (dockerd --iptables=false is enough).
# DSEC_CLUSTER=3 runs NATS as a 3-node JetStream cluster, every stream R3 (compose/cluster.yml).
# DSEC_HOSTS=3 runs three hosts (host agent + lazy loader each, a network namespace each) instead of
# one (compose/hosts.yml); `up` then waits until all three are ready.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
project="${DSEC_COMPOSE_PROJECT:-dsec}"
cache="${DSEC_CACHE_DIR:-/var/cache/dsec}"
py="${DSEC_PYTHON:-python3}"
compose=(docker-compose -p "$project" -f compose/docker-compose.yml)
if [ "${DSEC_CLUSTER:-1}" = 3 ]; then
  compose+=(-f compose/cluster.yml)
  # the extra hosts get the seed list and R3 like every other service
  export DSEC_HOSTS_NATS_URL="nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222" DSEC_NATS_REPLICAS=3
fi
hosts="${DSEC_HOSTS:-1}"
case "$hosts" in
  1) ;;
  3) compose+=(-f compose/hosts.yml) ;;
  *) echo "dsec: DSEC_HOSTS is 1 or 3 (compose/hosts.yml), not $hosts; for other counts use dsec up --hosts N" >&2; exit 2 ;;
esac

wheels() {
  # Every Python dependency as a wheel, keyed on pyproject.toml: the image build installs offline.
  local key dir
  key="$(sha256sum pyproject.toml | cut -c1-12)"
  dir="$cache/wheels-$key"
  if [ ! -f "$dir/.done" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    "$py" - > "$dir/requirements.txt" <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join([*p["dependencies"], *p["optional-dependencies"]["images"], *p.get("build-system", {}).get("requires", []), "setuptools>=68", "wheel"]))
PY
    echo "dsec: wheels for the image into $dir" >&2
    "$py" -m pip wheel -q --disable-pip-version-check -w "$dir" -r "$dir/requirements.txt" >&2
    touch "$dir/.done"
  fi
  rm -rf compose/.wheels && mkdir -p compose/.wheels
  cp -l "$dir"/*.whl compose/.wheels/ 2>/dev/null || cp "$dir"/*.whl compose/.wheels/
}

build() {
  local base
  base="$(bash compose/base-image.sh)"
  wheels
  DSEC_BASE="$base" "${compose[@]}" build -q >&2
}

wait_ready() {
  # `dsec status` exits 0 once a host is ready and templates are there; with DSEC_HOSTS, every host.
  local cli="${DSEC_CLI:-$here/.venv/bin/dsec}" deadline=$((SECONDS + ${DSEC_READY_TIMEOUT:-300}))
  until DSEC_NATS_URL="nats://127.0.0.1:${DSEC_NATS_PORT:-4222}" "$cli" status --json 2>/dev/null \
      | "$py" -c "import json,sys; sys.exit(0 if json.load(sys.stdin)['ready_hosts'] >= $hosts else 1)" 2>/dev/null; do
    if [ $SECONDS -gt $deadline ]; then
      echo "dsec: the compose stack is not ready; see: ${compose[*]} logs" >&2
      return 1
    fi
    sleep 1  # readiness poll
  done
}

case "${1:-}" in
  build) build ;;
  up)
    build
    "${compose[@]}" up -d --scale placement=2 >&2
    wait_ready
    echo "dsec: compose stack $project ready: DSEC_NATS_URL=nats://127.0.0.1:${DSEC_NATS_PORT:-4222}, gateway http://127.0.0.1:${DSEC_HTTP_PORT:-3000}/ (metrics, dashboard)"
    ;;
  down) "${compose[@]}" down -v --remove-orphans -t 90 >&2 ;;
  *) echo "usage: bash compose/stack.sh build|up|down" >&2; exit 2 ;;
esac
