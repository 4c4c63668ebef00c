#!/usr/bin/env bash
# Idempotent host set-up for SPACE on Debian 12 as root: Debian packages, runsc from Debian 13
# (see docs/adr/0002-runsc-from-trixie.md), and the project's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STAMP_DIR=${SPACE_SETUP_STAMPS:-/var/lib/space-setup}
mkdir -p "$STAMP_DIR"

APT_PACKAGES=(btrfs-progs iproute2 nftables debootstrap util-linux procps psmisc ca-certificates
              python3 python3-venv cpio busybox-static postgresql)

need_apt=0
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  echo "setup: installing Debian packages: ${APT_PACKAGES[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
fi

# runsc: Debian 13's build (has --net-disconnect-ok and a working checkpoint), fetched from the same
# mirror the machine already uses, through a private sources list so the host's suites stay untouched.
if ! runsc --version 2>/dev/null | grep -q "20240729"; then
  mirror=$(python3 "$ROOT/scripts/apt_mirror.py")
  echo "setup: fetching runsc from Debian 13 (trixie) at $mirror"
  tmp=$(mktemp -d)
  mkdir -p "$tmp/lists/partial" "$tmp/archives/partial"
  chmod -R a+rwX "$tmp"  # apt's download user must be able to write there
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$tmp/sources.list"
  apt_opts=(-o Dir::Etc::SourceList="$tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::State::Lists="$tmp/lists" -o Dir::Cache::Archives="$tmp/archives"
            -o APT::Get::List-Cleanup=0)
  apt-get "${apt_opts[@]}" update -qq
  (cd "$tmp" && apt-get "${apt_opts[@]}" download runsc -qq)
  dpkg -i "$tmp"/runsc_*.deb >/dev/null
  rm -rf "$tmp"
fi

# The unprivileged node agent runs from this virtual environment, so it is built on Debian's own python3
# (world-readable), never on an interpreter under a private home directory.
if ! id space >/dev/null 2>&1; then
  useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin space
fi
if [ -x .venv/bin/python ] && [ "$(readlink -f .venv/bin/python)" != "$(readlink -f /usr/bin/python3)" ]; then
  echo "setup: re-creating .venv on /usr/bin/python3"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating virtual environment .venv"
  /usr/bin/python3 -m venv .venv
fi
hash_now=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat .venv/.pyproject.sha256 2>/dev/null)" != "$hash_now" ]; then
  echo "setup: installing Python dependencies"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[dev]"
  echo "$hash_now" > .venv/.pyproject.sha256
fi
echo "setup: done"
