"""Two nodes whose helpers start at the same moment never choose the same address block (netns.claim_block).

A block is free when no address or route of the machine touches it, and a node's gateway address goes on a
link only after the choice: two helpers preparing together (a two-node test cluster, two nodes on one
host) could both see the same block free, and the second gateway could then not listen on its address.
Here the machine's addresses are a list the test controls and the "link" is slow to come up; the choice
and the claim must be one step.
"""

from __future__ import annotations

import ipaddress
import pathlib
import threading
import time

import pytest

from space.node.helper import netns


def test_helpers_preparing_together_claim_different_blocks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_links: list[ipaddress.IPv4Network] = []
    monkeypatch.setattr(netns, "BLOCK_LOCK", tmp_path / "lock" / "blocks.lock")
    monkeypatch.setattr(netns, "_networks_in_use", lambda: list(on_links))

    def slow_link(block: ipaddress.IPv4Network) -> None:
        time.sleep(0.1)  # `ip link add` and `addr replace` take a while
        on_links.append(ipaddress.IPv4Network(f"{block.network_address + 1}/32"))

    chosen: list[ipaddress.IPv4Network] = []
    same_tag = "00aa11"  # the worst case: both start their search at the same block
    threads = [
        threading.Thread(target=lambda: chosen.append(netns.claim_block(same_tag, slow_link)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(chosen) == 3 and len(set(chosen)) == 3, chosen
    assert all(block.subnet_of(netns.ADDRESS_SPACE) for block in chosen)
    assert (tmp_path / "lock" / "blocks.lock").exists()


def test_a_failed_claim_releases_the_lock(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "BLOCK_LOCK", tmp_path / "blocks.lock")
    monkeypatch.setattr(netns, "_networks_in_use", list)

    def broken(block: ipaddress.IPv4Network) -> None:
        raise RuntimeError("ip failed")

    with pytest.raises(RuntimeError, match="ip failed"):
        netns.claim_block("00aa11", broken)
    done = threading.Event()
    threading.Thread(target=lambda: (netns.claim_block("00aa11", lambda block: None), done.set())).start()
    assert done.wait(5), "the lock stayed held after a failed claim"
