"""A package mirror for template build tests: a Debian repository and a Python package index served over HTTP
from a network namespace of the test's own (tests/support/egress_net.py), which stands for the Debian archive
and the package index of the Internet (tests send no traffic anywhere else).

What it serves, all made here from what the test machine has, so nothing is downloaded:
- `debian/`: a flat apt repository (`deb [trusted=yes] http://<host>/debian ./`) with `space-build-probe`, a
  tiny package made with dpkg-deb (one script, /usr/bin/space-build-probe), and `python3-pip`, made from the
  pip this test process runs, as one zip on python3's path (the python template has no pip; a build's pip
  step installs it with apt);
- `simple/`: a PEP 503 index holding `spaceprobe`, a pure-python wheel made here.
"""

from __future__ import annotations

import base64
import hashlib
import io
import pathlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

import pip

from tests.support.egress_net import Upstream, veth_namespace, wait_port

PROBE_DEB = "space-build-probe"
PROBE_WHEEL = "spaceprobe"


@dataclass
class Mirror:
    upstream: Upstream
    host: str  # the name the node's egress resolver maps to the upstream

    @property
    def apt_sources(self) -> str:
        return f"deb [trusted=yes] http://{self.host}/debian ./\n"

    @property
    def pip_index(self) -> str:
        return f"http://{self.host}/simple/"

    def close(self) -> None:
        self.upstream.close()


def _deb(root: pathlib.Path, name: str, version: str, depends: str, files: dict[str, tuple[bytes, int]],
         out: pathlib.Path) -> pathlib.Path:  # fmt: skip
    pkg = root / f"{name}-pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    control = (
        f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: SPACE tests <t@example.com>\n"
        f"Depends: {depends}\nDescription: made by SPACE's template build tests\n"
    )
    (pkg / "DEBIAN" / "control").write_text(control)
    for path, (content, mode) in files.items():
        target = pkg / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    deb = out / f"{name}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(pkg), str(deb)],
                   check=True, capture_output=True)  # fmt: skip
    shutil.rmtree(pkg)
    return deb


def _pip_zip() -> bytes:
    """The pip this process runs, as a zip with `pip/` at its top (byte code left out)."""
    source = pathlib.Path(pip.__file__).parent
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for path in sorted(source.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                archive.write(path, "pip/" + str(path.relative_to(source)))
    return buffer.getvalue()


def _packages_index(debs: list[pathlib.Path]) -> str:
    stanzas = []
    for deb in debs:
        control = subprocess.run(["dpkg-deb", "-f", str(deb)], check=True, capture_output=True, text=True)
        data = deb.read_bytes()
        stanzas.append(
            control.stdout.rstrip("\n")
            + f"\nFilename: ./{deb.name}\nSize: {len(data)}\nSHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    return "\n".join(stanzas)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(out: pathlib.Path, value: str) -> pathlib.Path:
    dist = f"{PROBE_WHEEL}-1.0.dist-info"
    files = {
        f"{PROBE_WHEEL}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE_WHEEL}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: space-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items()) + f"{dist}/RECORD,,\n"
    wheel = out / f"{PROBE_WHEEL}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{dist}/RECORD", record)
    return wheel


def make_content(www: pathlib.Path, value: str) -> None:
    """The repository and the index under `www`; `value` is what the wheel's module holds."""
    debian = www / "debian"
    debian.mkdir(parents=True)
    probe = b"#!/bin/sh\necho space-build-probe ok\n"
    debs = [
        _deb(www, PROBE_DEB, "1.0", "dash", {"/usr/bin/space-build-probe": (probe, 0o755)}, debian),
        # pip as one zip on python3's path (pip runs from a zip, as get-pip's does): two files to unpack
        # instead of pip's thousand, which in gVisor is most of what installing pip costs
        _deb(www, "python3-pip", f"{pip.__version__}-0space1", "python3", {
            "/usr/lib/python3/pip.zip": (_pip_zip(), 0o644),
            "/usr/lib/python3/dist-packages/pip-zip.pth": (b"/usr/lib/python3/pip.zip\n", 0o644),
        }, debian),
    ]  # fmt: skip
    (debian / "Packages").write_text(_packages_index(debs))
    files = www / "files"
    files.mkdir()
    wheel = _wheel(files, value)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    project = www / "simple" / PROBE_WHEEL
    project.mkdir(parents=True)
    (project / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>'
        "</body></html>\n"
    )
    (www / "simple" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{PROBE_WHEEL}/">{PROBE_WHEEL}</a></body></html>\n'
    )


def start_mirror(tag: str, subnet: int, www: pathlib.Path, host: str = "mirror.test") -> Mirror:
    """An HTTP server of `www` at 10.98.<subnet>.2:80 in namespace `<tag>-mirror`."""
    namespace = f"{tag}-mirror"
    host_if, peer_if = f"{tag[-8:]}mih"[-15:], f"{tag[-8:]}min"[-15:]
    host_addr, addr = f"10.98.{subnet}.1", f"10.98.{subnet}.2"
    upstream = Upstream("mirror", namespace, host_addr, addr, www / "requests.jsonl", host_if)
    try:
        veth_namespace(namespace, host_if, peer_if, host_addr, addr)
        upstream.process = subprocess.Popen(
            # nsenter, not `ip netns exec` (see egress_net.start_upstream)
            ["nsenter", f"--net=/var/run/netns/{namespace}", sys.executable, "-m", "http.server", "80",
             "--bind", addr, "--directory", str(www)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_port(addr, 80)
    except BaseException:
        upstream.close()
        raise
    return Mirror(upstream, host)
