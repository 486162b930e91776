#!/usr/bin/env bash
# Install the Debian packages moed needs to build and test. Idempotent: runs
# apt-get only for packages that are missing. Run as root (or with sudo).
set -euo pipefail
PKGS=(build-essential pkg-config libuv1-dev libcjson-dev libsystemd-dev check
      python3 python3-venv python3-pip curl clang)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "deps: all of ${PKGS[*]} installed"
