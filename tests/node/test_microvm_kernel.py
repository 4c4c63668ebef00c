"""The microVM guest's module list comes from the kernel's own metadata, and the accelerator is detected."""

from __future__ import annotations

import pathlib

import pytest

from space.core.errors import RuntimeFailure
from space.node.helper.microvm_kernel import (
    GUEST_MODULES,
    ModuleMetadata,
    init_script,
    module_order,
    template_initramfs,
)
from space.node.helper.microvm_qemu import MachineSpec, detect_accel, host_tsc_khz, qemu_argv
from space.node.helper.netaddr import EDGE_INNER_MAC, MICROVM_TAP, SANDBOX_MAC

# Lines as depmod -b writes them for Debian 12's 6.1 kernel (trimmed to the modules that matter).
DEP = """kernel/fs/ext4/ext4.ko: kernel/fs/jbd2/jbd2.ko kernel/fs/mbcache.ko kernel/lib/crc16.ko
kernel/fs/jbd2/jbd2.ko:
kernel/fs/mbcache.ko:
kernel/lib/crc16.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/arch/x86/crypto/crc32c-intel.ko:
kernel/crypto/crc32c_generic.ko:
"""
SOFTDEP = "softdep ext4 pre: crypto-crc32c\nsoftdep jbd2 pre: crypto-crc32c\n"
ALIAS = (
    "alias crypto-crc32c crc32c_intel\nalias crc32c crc32c_intel\n"
    "alias crypto-crc32c crc32c_generic\nalias crc32c crc32c_generic\n"
)


def test_module_order_follows_dependencies_soft_dependencies_and_aliases() -> None:
    order = module_order(ModuleMetadata(DEP, SOFTDEP, ALIAS), ("virtio_mmio", "virtio_blk", "ext4"))
    names = [path.rsplit("/", 1)[-1] for path in order]
    assert names == [
        "virtio_ring.ko", "virtio.ko", "virtio_mmio.ko", "virtio_blk.ko",
        "crc32c-intel.ko", "crc32c_generic.ko", "crc16.ko", "mbcache.ko", "jbd2.ko", "ext4.ko",
    ]  # fmt: skip
    assert len(set(order)) == len(order)


def test_the_network_device_and_its_dependencies_come_from_the_metadata() -> None:
    """virtio_net is one of the guest's modules; what it needs (failover, as Debian's 6.1 has it) comes from
    modules.dep, not from a list here (docs/adr/0080-microvm-egress.md)."""
    assert "virtio_net" in GUEST_MODULES
    dep = DEP + (
        "kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko"
        " kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko\nkernel/net/core/failover.ko:\n"
    )
    names = [path.rsplit("/", 1)[-1] for path in module_order(ModuleMetadata(dep), ("virtio_net",))]
    assert names == ["virtio_ring.ko", "virtio.ko", "failover.ko", "net_failover.ko", "virtio_net.ko"]


def test_init_script_gives_eth0_the_address_every_sandbox_has() -> None:
    script = init_script(["virtio_net.ko"])
    assert "ip addr add 10.99.0.2/30 dev eth0" in script
    assert "ip route add default via 10.99.0.1 dev eth0" in script
    # the edge's MAC is fixed: a restored guest's neighbour entry is right in every slot
    assert f"ip neigh replace 10.99.0.1 lladdr {EDGE_INNER_MAC} dev eth0 nud permanent" in script
    assert script.index("ip route add default") < script.index("exec switch_root")


def test_module_order_refuses_a_missing_module_and_a_cycle() -> None:
    with pytest.raises(RuntimeFailure, match="no module virtio_console"):
        module_order(ModuleMetadata(DEP.replace("virtio_console", "other")), ("virtio_console",))
    cyclic = "kernel/a.ko: kernel/b.ko\nkernel/b.ko: kernel/a.ko\n"
    with pytest.raises(RuntimeFailure, match="cycle"):
        module_order(ModuleMetadata(cyclic), ("a",))


def test_init_script_loads_the_modules_in_order_and_runs_the_daemon_on_the_port() -> None:
    script = init_script(["virtio_ring.ko", "virtio.ko", "ext4.ko"])
    loads = [line for line in script.splitlines() if line.startswith("insmod")]
    assert loads == [f"insmod /lib/modules/{n}" for n in ("virtio_ring.ko", "virtio.ko", "ext4.ko")]
    assert "export SPACED_CHANNEL=/dev/$port" in script
    assert script.rstrip().splitlines()[-1].startswith("exec switch_root /newroot /usr/bin/python3 -I -S -B")


def test_template_environment_is_quoted_and_names_are_checked(tmp_path: pathlib.Path) -> None:
    base = tmp_path / "base.cpio"
    base.write_bytes(b"")
    from space.node.helper.microvm_kernel import GuestKernel

    kernel = GuestKernel("r", tmp_path / "vmlinuz", base, ())
    out = tmp_path / "initrd"
    template_initramfs(kernel, {"GREETING": "it's $(reboot)"}, out)
    assert b"GREETING='it'\"'\"'s $(reboot)'\n" in out.read_bytes()
    with pytest.raises(RuntimeFailure, match="cannot be exported"):
        template_initramfs(kernel, {"BAD;reboot": "x"}, out)


def test_accelerator_is_kvm_only_with_a_hardware_kvm_module(tmp_path: pathlib.Path) -> None:
    device = tmp_path / "kvm"
    device.write_bytes(b"")
    modules = tmp_path / "module"
    (modules / "kvm_pvm").mkdir(parents=True)
    assert detect_accel(device, modules) == "tcg"  # a nested PVM /dev/kvm runs no stock guest kernel
    (modules / "kvm_intel").mkdir()
    assert detect_accel(device, modules) == "kvm"
    assert detect_accel(tmp_path / "missing", modules) == "tcg"


def test_qemu_runs_jailed_and_takes_no_path_after_start(tmp_path: pathlib.Path) -> None:
    spec = MachineSpec(tmp_path / "k", tmp_path / "i", tmp_path / "d", tmp_path / "q", tmp_path / "j", 70001)
    argv = qemu_argv(spec)
    assert argv[:7] == [
        "unshare",
        "--mount",
        "--net",  # no slot: an empty network namespace, where the tap leads nowhere
        "--propagation",
        "slave",  # the host's unmounts (a deleted slot's /run/netns entry) reach QEMU's copy
        f"--wd={tmp_path / 'j'}",
        "--",
    ]
    # the same virtio-net device in every guest (so every checkpoint restores in any slot), on the tap
    assert argv[argv.index("-netdev") + 1] == f"tap,id=net0,ifname={MICROVM_TAP},script=no,downscript=no"
    assert argv[argv.index("-device", argv.index("-netdev")) + 1] == (
        f"virtio-net-device,netdev=net0,mac={SANDBOX_MAC}"
    )
    slot = pathlib.Path("/run/netns/sp000000s3")
    in_slot = qemu_argv(MachineSpec(**{**spec.__dict__, "netns": slot}))
    assert in_slot[:8] == ["nsenter", f"--net={slot}", "unshare", "--mount", "--propagation", "slave",
                           f"--wd={tmp_path / 'j'}", "--"]  # fmt: skip
    assert in_slot[8:] == argv[7:]
    assert argv[argv.index("-sandbox") + 1].startswith("on,obsolete=deny,spawn=deny")
    assert argv[argv.index("-runas") + 1] == "70001:70001"
    assert argv[argv.index("-chroot") + 1] == str(tmp_path / "j")
    assert f"tsc_early_khz={host_tsc_khz()}" in argv[argv.index("-append") + 1]
    assert "-incoming" not in argv
    assert qemu_argv(MachineSpec(**{**spec.__dict__, "incoming": True}))[-2:] == ["-incoming", "defer"]
    with pytest.raises(Exception, match="accelerator"):
        qemu_argv(MachineSpec(**{**spec.__dict__, "accel": "hvf"}))
