"""The microVM guest's kernel and initramfs: Debian's own kernel package, built into a node cache once.

The `qemu` driver (docs/adr/0068-qemu-microvm-driver.md) boots Debian's `linux-image-<release>-amd64`
(the version the machine's `linux-image-amd64` depends on, fetched with `apt-get download` from the
machine's configured mirror and unpacked with `dpkg-deb -x`). The initramfs holds a static busybox, the
modules the guest needs and an init script that loads them, mounts the root disk and hands PID 1 to spaced.

Invariants:
- The module list is resolved from the kernel's own metadata: `depmod -b` over the unpacked tree writes
  `modules.dep`, `modules.softdep` and `modules.alias`, and the initramfs loads GUEST_MODULES and their
  transitive dependencies in dependency order (every module after all it needs). No module file name is
  written here by hand.
- The cache directory holds complete builds only: a build happens in a temporary directory that is renamed
  into place, under a flock, so concurrent helpers build once and a killed build leaves nothing usable.
- The init script reads no input from the disk image before it is mounted, and the disk image never chooses
  what PID 1 runs: the command is fixed here (the template's daemon, space.node.volumes.templates).
"""

from __future__ import annotations

import contextlib
import lzma
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from space.core.errors import RuntimeFailure
from space.node.helper.netaddr import EDGE_INNER_MAC, SANDBOX_ADDR, SANDBOX_GATEWAY, SANDBOX_PREFIX
from space.node.volumes.template_files import flock, run
from space.node.volumes.templates import guest_command

#: What the guest needs from its kernel: the microvm machine's virtio-mmio transport, the root disk, the
#: channel's serial port, the network device (docs/adr/0080-microvm-egress.md) and the root filesystem.
#: Their dependencies come from modules.dep.
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "ext4")
KERNEL_META_PACKAGE = "linux-image-amd64"
DEFAULT_CACHE_DIR = Path("/var/cache/space/microvm")
BUSYBOX = Path("/bin/busybox")
#: The name of the channel's virtio serial port (virtserialport name=...); the init script finds its device.
CHANNEL_PORT_NAME = "space.0"
#: Bumped when the initramfs recipe changes: a new cache entry.
INITRAMFS_VERSION = "5"

_DEPENDS = re.compile(r"Depends:\s+(linux-image-[0-9][A-Za-z0-9.+-]*-amd64)\b")
_RELEASE = re.compile(r"^linux-image-([0-9][A-Za-z0-9.+-]*-amd64)$")


@dataclass(frozen=True)
class GuestKernel:
    release: str
    vmlinuz: Path
    initramfs: Path  # the node-wide part; a template's own part is appended (template_initramfs)
    modules: tuple[str, ...]  # load order, as written into the initramfs


def kernel_package() -> str:
    """The kernel package the machine's metapackage depends on (e.g. linux-image-6.1.0-57-amd64)."""
    try:
        shown = run(["apt-cache", "depends", KERNEL_META_PACKAGE], "apt-cache depends").stdout
    except RuntimeFailure:
        # No package lists (a cleaned apt cache): fetch them from the machine's configured sources once.
        run(["apt-get", "update", "-qq"], "apt-get update")
        shown = run(["apt-cache", "depends", KERNEL_META_PACKAGE], "apt-cache depends").stdout
    match = _DEPENDS.search(shown)
    if match is None:
        raise RuntimeFailure(f"{KERNEL_META_PACKAGE} names no kernel package: {shown[:200]!r}")
    return match.group(1)


@dataclass(frozen=True)
class ModuleMetadata:
    """The texts depmod writes for one kernel release (modules.dep, modules.softdep, modules.alias)."""

    dep: str
    softdep: str = ""
    alias: str = ""

    @classmethod
    def read(cls, module_dir: Path) -> ModuleMetadata:
        def text(name: str) -> str:
            path = module_dir / name
            return path.read_text() if path.is_file() else ""

        return cls(text("modules.dep"), text("modules.softdep"), text("modules.alias"))


def _dependency_graph(metadata: ModuleMetadata) -> tuple[dict[str, list[str]], dict[str, str]]:
    """{module path: paths to load before it (soft `pre:` ones, then hard ones last-listed first, as modprobe
    loads them)}, and {module name: path}."""
    hard: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in metadata.dep.splitlines():
        if ":" in line:
            path, _, rest = line.partition(":")
            hard[path.strip()] = rest.split()
            by_name[_module_name(path.strip())] = path.strip()
    aliases: dict[str, list[str]] = {}
    for fields in (line.split() for line in metadata.alias.splitlines()):
        if len(fields) == 3 and fields[0] == "alias" and fields[2] in by_name:
            aliases.setdefault(fields[1], []).append(by_name[fields[2]])
    soft: dict[str, list[str]] = {}
    for fields in (line.split() for line in metadata.softdep.splitlines()):
        module = fields[1].replace("-", "_") if len(fields) > 2 and fields[0] == "softdep" else ""
        if module not in by_name or "pre:" not in fields:
            continue
        pre = fields[fields.index("pre:") + 1 :]
        for name in pre[: pre.index("post:")] if "post:" in pre else pre:
            plain = name.replace("-", "_")
            found = aliases.get(name) or ([by_name[plain]] if plain in by_name else [])
            soft.setdefault(by_name[module], []).extend(found)
    return {path: [*soft.get(path, []), *reversed(deps)] for path, deps in hard.items()}, by_name


def module_order(metadata: ModuleMetadata, wanted: tuple[str, ...]) -> list[str]:
    """Paths (relative to the release's module directory) of `wanted` and everything they need, each after
    its dependencies: the hard ones of modules.dep, and the `pre:` soft ones of modules.softdep (ext4's
    crc32c, which the crypto API loads by name), through modules.alias for names that are aliases."""
    deps, by_name = _dependency_graph(metadata)
    order: list[str] = []

    def visit(path: str, trail: tuple[str, ...]) -> None:
        if path in order:
            return
        if path in trail:
            raise RuntimeFailure(f"the module metadata has a dependency cycle through {path}")
        if path not in deps:
            raise RuntimeFailure(f"modules.dep does not list {path}")
        for needed in deps[path]:
            visit(needed, (*trail, path))
        order.append(path)

    for name in wanted:
        if name not in by_name:
            raise RuntimeFailure(f"the guest kernel has no module {name} (built in or missing)")
        visit(by_name[name], ())
    return order


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for suffix in (".ko.xz", ".ko.zst", ".ko.gz", ".ko"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.replace("-", "_")


def ensure_guest_kernel(cache_dir: Path = DEFAULT_CACHE_DIR) -> GuestKernel:
    """The cached guest kernel, built once from the machine's kernel package (see module invariants). A
    complete build in the cache is used as it is: apt is asked only when there is none."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache_dir.chmod(0o755)
    with flock(cache_dir / ".lock"):
        built = sorted(cache_dir.glob(f"*-amd64-initramfs{INITRAMFS_VERSION}/modules.order"))
        if built:
            target = built[-1].parent
        else:
            package = kernel_package()
            match = _RELEASE.match(package)
            if match is None:
                raise RuntimeFailure(f"unexpected kernel package name {package!r}")
            target = cache_dir / f"{match.group(1)}-initramfs{INITRAMFS_VERSION}"
            _build(package, match.group(1), cache_dir, target)
    release = target.name.removesuffix(f"-initramfs{INITRAMFS_VERSION}")
    modules = tuple((target / "modules.order").read_text().split())
    return GuestKernel(release, target / "vmlinuz", target / "initramfs.cpio", modules)


def _build(package: str, release: str, cache_dir: Path, target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        download = work / "download"
        download.mkdir()
        # apt's download method runs as root into this root-only directory (as scripts/setup.sh does).
        run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package],
            "apt-get download of the guest kernel", cwd=download)  # fmt: skip
        debs = sorted(download.glob("*.deb"))
        if len(debs) != 1:
            raise RuntimeFailure(f"apt-get download of {package} gave {len(debs)} packages")
        tree = work / "tree"
        run(["dpkg-deb", "-x", str(debs[0]), str(tree)], "dpkg-deb -x of the guest kernel")
        run(["depmod", "-b", str(tree), release], "depmod of the guest kernel")
        module_dir = tree / "lib" / "modules" / release
        order = module_order(ModuleMetadata.read(module_dir), GUEST_MODULES)
        staged = work / "out"
        staged.mkdir()
        shutil.copyfile(tree / "boot" / f"vmlinuz-{release}", staged / "vmlinuz")
        names = _initramfs_tree(work / "initramfs", module_dir, order)
        _write_cpio(work / "initramfs", staged / "initramfs.cpio")
        (staged / "modules.order").write_text("\n".join(names) + "\n")
        for path in staged.iterdir():
            path.chmod(0o644)
        staged.chmod(0o755)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        staged.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _initramfs_tree(root: Path, module_dir: Path, order: list[str]) -> list[str]:
    for sub in ("bin", "dev", "proc", "sys", "newroot", "lib/modules"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(BUSYBOX, root / "bin" / "busybox")
    (root / "bin" / "busybox").chmod(0o755)
    names: list[str] = []
    for relative in order:
        name = _module_name(relative) + ".ko"
        data = (module_dir / relative).read_bytes()
        if relative.endswith(".xz"):
            data = lzma.decompress(data)  # busybox's insmod takes plain modules
        (root / "lib" / "modules" / name).write_bytes(data)
        names.append(name)
    (root / "init").write_text(init_script(names))
    (root / "init").chmod(0o755)
    return names


def init_script(modules: list[str]) -> str:
    """PID 1 of the initramfs: load the modules, mount the root disk, find the channel's port, give eth0
    the address every sandbox has (a gVisor netstack takes the same from its namespace; the edge's MAC is
    fixed, so a static neighbour stays right in every slot a checkpoint is restored into), and exec spaced
    as PID 1 of the root filesystem with the environment the template's part supplies."""
    daemon = " ".join(shlex.quote(arg) for arg in guest_command())
    loads = "\n".join(f"insmod /lib/modules/{name}" for name in modules)
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
{loads}
n=0
while [ ! -b /dev/vda ] && [ $n -lt 500 ]; do sleep 0.01; n=$((n+1)); done
mount -t ext4 -o rw,noatime /dev/vda /newroot || exec poweroff -f
port=
n=0
while [ -z "$port" ] && [ $n -lt 500 ]; do
  for f in /sys/class/virtio-ports/*/name; do
    [ "$(cat "$f" 2>/dev/null)" = {CHANNEL_PORT_NAME} ] && port=$(basename "$(dirname "$f")")
  done
  [ -z "$port" ] && sleep 0.01
  n=$((n+1))
done
[ -n "$port" ] || exec poweroff -f
ip link set lo up
n=0
while [ ! -e /sys/class/net/eth0 ] && [ $n -lt 500 ]; do sleep 0.01; n=$((n+1)); done
if [ -e /sys/class/net/eth0 ]; then
  echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6
  ip link set eth0 up
  ip addr add {SANDBOX_ADDR}/{SANDBOX_PREFIX} dev eth0
  ip neigh replace {SANDBOX_GATEWAY} lladdr {EDGE_INNER_MAC} dev eth0 nud permanent
  ip route add default via {SANDBOX_GATEWAY} dev eth0
fi
mkdir -p /newroot/proc /newroot/sys /newroot/dev /newroot/tmp /newroot/run
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
hostname sandbox
set -a
. /space-env
set +a
export SPACED_CHANNEL=/dev/$port
exec switch_root /newroot {daemon}
"""


def _write_cpio(root: Path, out: Path) -> None:
    """An uncompressed newc archive of `root` (the kernel unpacks it without a decompressor)."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    with out.open("wb") as sink:
        try:
            subprocess.run(
                ["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
                input="\n".join(names).encode(), stdout=sink, stderr=subprocess.PIPE, cwd=root, check=True,
            )  # fmt: skip
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeFailure(f"cpio of the guest initramfs failed: {exc}") from exc


def template_initramfs(kernel: GuestKernel, environment: Mapping[str, str], out: Path) -> None:
    """The node-wide initramfs plus a second archive holding `/space-env` (the template's daemon
    environment, shell-quoted): the kernel unpacks concatenated archives in order."""
    for key in environment:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise RuntimeFailure(f"environment variable name {key!r} cannot be exported by the guest init")
    lines = "".join(f"{key}={shlex.quote(value)}\n" for key, value in sorted(environment.items()))
    work = Path(tempfile.mkdtemp(prefix=".env-", dir=out.parent))
    try:
        (work / "space-env").write_text(lines)
        (work / "space-env").chmod(0o644)
        _write_cpio(work, work / "env.cpio")
        tmp = out.with_name(out.name + ".tmp")
        with tmp.open("wb") as sink:
            sink.write(kernel.initramfs.read_bytes())
            sink.write((work / "env.cpio").read_bytes())
        os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
