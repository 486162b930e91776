#!/usr/bin/env bash
# Install the Debian packages moed needs to build and test. Idempotent: runs
# apt-get only for packages that are missing. Run it as yourself: it uses sudo
# for apt-get when it is not root (as root, no sudo is needed).
# systemd gives systemd-analyze (make test verifies the unit with it).
set -euo pipefail
PKGS=(build-essential pkg-config libuv1-dev libcjson-dev libsystemd-dev check
      python3 python3-venv python3-pip curl clang systemd)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "deps: not root and no sudo: run as root" >&2; exit 1; }
        SUDO=sudo
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# promtool (make test lints /metrics with it): only the one binary out of
# Debian's prometheus package, unpacked, so that no Prometheus server is
# installed or started.
if ! command -v promtool >/dev/null; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    d=$(mktemp -d)
    if (cd "$d" && apt-get download -qq prometheus >/dev/null 2>&1 &&
        dpkg-deb -x prometheus_*.deb x); then
        $SUDO install -m 755 "$d/x/usr/bin/promtool" /usr/local/bin/promtool
        echo "deps: promtool from $(basename "$d"/prometheus_*.deb)"
    else
        echo "deps: promtool not available (apt-get download prometheus failed); its check skips"
    fi
    rm -rf "$d"
fi
echo "deps: all of ${PKGS[*]} installed"
