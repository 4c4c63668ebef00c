#!/usr/bin/env bash
# Idempotent host set-up for SPACE on Debian 12 as root: Debian packages, runsc from Debian 13
# (see docs/adr/0002-runsc-from-trixie.md), and the project's virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STAMP_DIR=${SPACE_SETUP_STAMPS:-/var/lib/space-setup}
mkdir -p "$STAMP_DIR"

APT_PACKAGES=(btrfs-progs iproute2 nftables debootstrap util-linux procps psmisc ca-certificates
              python3 python3-venv cpio busybox-static postgresql
              qemu-system-x86 kmod e2fsprogs  # the qemu driver: QEMU, depmod, mkfs.ext4 (ADR 0068)
              chromium)  # chromium: the web console's end-to-end test drives it (ADR 0061)

need_apt=0
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep "install ok installed" >/dev/null || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  echo "setup: installing Debian packages: ${APT_PACKAGES[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${APT_PACKAGES[@]}" >/dev/null
fi

# runsc: Debian 13's build (has --net-disconnect-ok and a working checkpoint), fetched from the same
# mirror the machine already uses, through a private sources list so the host's suites stay untouched.
# The download goes into a root-only directory (mktemp -d: 0700) that nobody else can write to between the
# download and `dpkg -i`; apt runs its download methods as root for it (APT::Sandbox::User=root) rather than
# the directory being opened to its `_apt` user. apt checks the index's signature (signed-by) and the
# package's hash against it; the hash is checked once more here before root installs the package.
fetch_runsc() {
  local mirror work apt_opts uri_line want got deb
  mirror=$(python3 "$ROOT/scripts/apt_mirror.py")
  echo "setup: fetching runsc from Debian 13 (trixie) at $mirror"
  mkdir -p /var/cache/space-setup
  chmod 0700 /var/cache/space-setup
  work=$(mktemp -d /var/cache/space-setup/runsc.XXXXXXXX)
  RUNSC_WORK=$work
  trap 'rm -rf "${RUNSC_WORK:-}"' EXIT
  mkdir -p "$work/lists/partial" "$work/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" > "$work/sources.list"
  apt_opts=(-o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
            -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq
  # 'URI' FILE SIZE SHA256:HASH, from the signature-checked index
  uri_line=$(cd "$work" && apt-get "${apt_opts[@]}" download --print-uris runsc -qq | head -n 1)
  deb=$(echo "$uri_line" | awk '{print $2}')
  want=$(echo "$uri_line" | awk '{print $4}' | sed -n 's/^SHA256://p')
  case "$deb" in runsc_*.deb) ;; *) echo "setup: unexpected runsc download: $uri_line" >&2; exit 1 ;; esac
  if [ -z "$want" ]; then echo "setup: the index gives no SHA256 for runsc" >&2; exit 1; fi
  (cd "$work" && apt-get "${apt_opts[@]}" download runsc -qq)
  got=$(sha256sum "$work/$deb" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    echo "setup: $deb does not match the signed index (sha256 $got, expected $want)" >&2
    exit 1
  fi
  if [ "${SPACE_SETUP_DOWNLOAD_ONLY:-}" = 1 ]; then  # download and verify only (to try this block)
    echo "setup: $deb matches the signed index (sha256 $got)"
  else
    dpkg -i "$work/$deb" >/dev/null
  fi
  rm -rf "$work"
  trap - EXIT
}
if [ "${SPACE_SETUP_DOWNLOAD_ONLY:-}" = 1 ]; then
  fetch_runsc
  exit 0
fi
# (grep reads all of its input: with `grep -q`, an early exit can SIGPIPE the writer and, under pipefail,
# make a match look like a miss.)
if ! runsc --version 2>/dev/null | grep "20240729" >/dev/null; then
  fetch_runsc
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
