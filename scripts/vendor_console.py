"""Fetch (or check) the web console's vendored front-end files (docs/adr/0061-web-console.md).

The console has no build step and loads nothing from a CDN: the few third-party files it needs are copied
from their npm packages into `src/space/controlplane/console/static/vendor/`, byte for byte, beside each
package's licence. Every package is pinned here by version AND by the sha256 of its `npm pack` tarball;
every copied file by its own sha256, so `--check` (no network) proves the tree holds exactly what was
reviewed, and a changed upstream tarball is refused before anything is copied.

    scripts/vendor_console.py           fetch with `npm pack` (the configured npm registry), verify, copy
    scripts/vendor_console.py --check   verify the vendored files against the pins (offline)

To update a package: change its version, run without --check (it refuses, printing the new tarball's
sha256), review the release, put the new sha256s here, run again, and commit the files and this script.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENDOR = ROOT / "src" / "space" / "controlplane" / "console" / "static" / "vendor"


@dataclass(frozen=True)
class Package:
    spec: str  # name@version, as npm pack takes it
    directory: str  # under VENDOR
    tarball_sha256: str
    files: dict[str, tuple[str, str]]  # path in the package -> (file name under directory, sha256)


PACKAGES = (
    Package(
        spec="@xterm/xterm@6.0.0",
        directory="xterm",
        tarball_sha256="908e66e04af6c8dc6b00dd3b54de088e2e81e5ed866284fd6c2fb3c2d1c7a3f6",
        files={
            "package/lib/xterm.mjs": (
                "xterm.mjs",
                "b336ec65a086c056d4804b3d4c2347da5663d3f23c3f25be866467bd8857ad59",
            ),
            "package/css/xterm.css": (
                "xterm.css",
                "854a7c0fb70e8b1a083c16797ab827299fb18744f5ad34f227b48337e33293c6",
            ),
            "package/LICENSE": (
                "LICENSE",
                "b569f629d00f2626a8100df2a1798210535621e42164dfd426a6fe5aac7b0ccd",
            ),
        },
    ),
    Package(
        spec="@xterm/addon-fit@0.11.0",
        directory="xterm-addon-fit",
        tarball_sha256="26003b4517a132b64e4ff228fd88a5fda3fff5e606c76093f6dcff772e9ecec0",
        files={
            "package/lib/addon-fit.mjs": (
                "addon-fit.mjs",
                "2d87e1bddc73be9111de8beee5370c3bb7aac9c94e18e6f245f02ca741ef1769",
            ),
            "package/LICENSE": (
                "LICENSE",
                "e256f01188af527e4d06d21d06fbf785ae9c50d4b328bf03cbe0ba7f0aa4228f",
            ),
        },
    ),
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(package: Package, work: pathlib.Path) -> None:
    """npm pack the package into `work`, check the tarball, copy its pinned files (checked) into VENDOR."""
    out = subprocess.run(
        ["npm", "pack", "--silent", package.spec, "--pack-destination", str(work)],
        check=True,
        capture_output=True,
        text=True,
        cwd=work,
    ).stdout.split()
    tarball = work / out[-1]
    got = sha256(tarball.read_bytes())
    if got != package.tarball_sha256:
        raise SystemExit(f"{package.spec}: tarball sha256 {got}, pinned {package.tarball_sha256}: refused")
    target = VENDOR / package.directory
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        for member, (name, want) in package.files.items():
            extracted = archive.extractfile(member)
            if extracted is None:
                raise SystemExit(f"{package.spec}: {member} is not a file in the tarball")
            data = extracted.read()
            if sha256(data) != want:
                raise SystemExit(f"{package.spec}: {member} sha256 {sha256(data)}, pinned {want}: refused")
            (target / name).write_bytes(data)
    print(f"{package.spec}: {len(package.files)} files in {target.relative_to(ROOT)}")


def check() -> list[str]:
    """What differs between the vendored files and the pins (empty: all good)."""
    problems = []
    expected = {VENDOR / p.directory / name for p in PACKAGES for name, _ in p.files.values()}
    for package in PACKAGES:
        for name, want in package.files.values():
            path = VENDOR / package.directory / name
            if not path.is_file():
                problems.append(f"missing: {path.relative_to(ROOT)}")
            elif sha256(path.read_bytes()) != want:
                problems.append(f"changed: {path.relative_to(ROOT)}")
    extra = [p for p in VENDOR.rglob("*") if p.is_file() and p not in expected]
    problems += [f"not pinned: {p.relative_to(ROOT)}" for p in extra]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the vendored files (no network)")
    args = parser.parse_args()
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    with tempfile.TemporaryDirectory() as work:
        for package in PACKAGES:
            fetch(package, pathlib.Path(work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
