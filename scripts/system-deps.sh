#!/usr/bin/env bash
# Install the Debian packages the tests (and, with --bench, the benchmarks) need, when missing.
# Idempotent: does nothing when every command is already on PATH.
set -euo pipefail

need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v kubectl >/dev/null || need+=(kubectl)
# nginx: tests/test_deploy.py checks deploy/gateway/nginx.conf with `nginx -t` and runs it.
command -v nginx >/dev/null || PATH="$PATH:/usr/sbin" command -v nginx >/dev/null || need+=(nginx)
# haproxy (Debian's, 2.6 on bookworm): tests/test_haproxy_agent.py checks deploy/gateway/haproxy.cfg
# with `haproxy -c` and runs it against real sidecars' agents.
command -v haproxy >/dev/null || PATH="$PATH:/usr/sbin" command -v haproxy >/dev/null || need+=(haproxy)
if [[ "${1:-}" == "--bench" ]]; then
  command -v wrk >/dev/null || need+=(wrk)
fi
[[ ${#need[@]} -eq 0 ]] && exit 0

sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
echo "installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
