"""Every tunable of the node agent and its local launcher in one place: `NodeAgentSettings`.

Invariants:
- This is the only module of the node agent (space.node.agent, space.node.local) that reads its
  environment variables; each field names its variable and documents it. (space.node.local and
  space.node.demo also copy a fixed list of variables, PATH and the like, into the environment of the
  processes they start: passed through, not read.)
- Names that existed before this class keep their meaning and spelling (matched case-sensitively, as
  `os.environ` did): `SPACE_STORE_URL` and `SPACE_DISK_RESERVE` (defaults of the agent's `--store-url` and
  `--disk-reserve`, which still win), `SPACE_ROOTFS_CACHE` (handed to the node helper). Every other field
  is read from `SPACE_NODE_<FIELD NAME IN CAPITALS>`, e.g. `SPACE_NODE_SETTLE_TIMEOUT_S`.
- Every default is the value the code had as a module constant before: unset variables change nothing.
- Settings are read when an instance is made: once per agent process (`launch.main`), or per app/node
  made in-process without one (tests, benchmarks).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1 << 20
#: The prefix of every variable this class introduced (the older ones keep their names).
ENV_PREFIX = "SPACE_NODE_"


def _node(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


class NodeAgentSettings(BaseSettings):
    """The node agent's tunables; each field's environment variable is its alias or SPACE_NODE_<NAME>."""

    model_config = SettingsConfigDict(case_sensitive=True, frozen=True, extra="ignore", populate_by_name=True)

    # -- defaults of command-line flags (the flags win) ------------------------------------------------------
    store_url: str | None = Field(
        default=None, validation_alias="SPACE_STORE_URL",
        description="Default of --store-url: the object store for templates and suspended sandboxes "
        "(file:///dir or s3://bucket/prefix?...); unset or empty: file://DATA_DIR/objects.",
    )  # fmt: skip
    disk_reserve: str = Field(
        default="5,2048", validation_alias="SPACE_DISK_RESERVE",
        description="Default of --disk-reserve: PERCENT,MB, the free space the node keeps (ADR 0027).",
    )  # fmt: skip

    # -- the local launcher (space.node.local) ---------------------------------------------------------------
    rootfs_cache: str | None = Field(
        default=None, validation_alias="SPACE_ROOTFS_CACHE",
        description="Where the node helper caches the template base's stream (unset: the machine-wide "
        "default); passed on to the helper, whose environment is otherwise only HELPER_ENV.",
    )  # fmt: skip
    helper_start_timeout_s: float = Field(
        validation_alias=_node("helper_start_timeout_s"),
        default=30.0,
        gt=0,
        description="How long a local node waits for its helper to open its socket.",
    )
    driver: Literal["runsc", "qemu"] = Field(
        validation_alias=_node("driver"), default="runsc",
        description="The isolation driver of this node's sandboxes: runsc (gVisor) or qemu (QEMU microVMs on "
        "a real guest kernel, KVM where the host has it, else TCG; ADR 0068).",
    )  # fmt: skip
    pools: str = Field(
        validation_alias=_node("pools"), default="",
        description="Default of --pools: warm pool sizes per template, TEMPLATE=N[,TEMPLATE=N...] "
        "(ADR 0047); empty: no pools.",
    )  # fmt: skip
    pool_fill_concurrency: int = Field(
        validation_alias=_node("pool_fill_concurrency"), default=1, ge=1, le=16,
        description="Pooled sandboxes made at once when pools need refilling (each is one restore).",
    )  # fmt: skip
    pool_fill_yield_s: float = Field(
        validation_alias=_node("pool_fill_yield_s"), default=0.5, ge=0,
        description="A pool refill waits up to this long for the node's lifecycle steps to finish first.",
    )  # fmt: skip
    helper_pool_size: int = Field(
        validation_alias=_node("helper_pool_size"),
        default=8,
        gt=0,
        description="Idle connections to the node helper kept for reuse.",
    )
    favor_cgroup_moves: bool = Field(
        validation_alias=_node("favor_cgroup_moves"), default=True,
        description="The local launcher's helper asks the kernel for cheap cgroup moves (favordynmods on the "
        "cgroup2 mount) when it prepares the node: each runtime start is ~20 ms faster, every fork and exit "
        "on the machine slightly dearer; the kernel keeps it until reboot (ADR 0086).",
    )  # fmt: skip
    helper_call_timeout_s: float = Field(
        validation_alias=_node("helper_call_timeout_s"),
        default=120.0,
        gt=0,
        description="A helper verb that names no timeout of its own fails after this.",
    )

    # -- the RPC service (space.node.agent.service, streams, routes) -----------------------------------------
    read_window_bytes: int = Field(
        validation_alias=_node("read_window_bytes"), default=4 * MiB, gt=0,
        description="A download asks the daemon for at most this much at a time: the channel has no "
        "per-call flow control, so this bounds what a slow HTTP reader can make the agent buffer.",
    )  # fmt: skip
    guest_info_timeout_s: float = Field(
        validation_alias=_node("guest_info_timeout_s"),
        default=2.0,
        gt=0,
        description="How long observing a sandbox waits for its daemon's sys.info.",
    )
    settle_timeout_s: float = Field(
        validation_alias=_node("settle_timeout_s"), default=120.0, gt=0,
        description="How long a request waits for an in-flight lifecycle step (pause, checkpoint...) to "
        "settle before it goes on.",
    )  # fmt: skip
    cancel_grace_s: float = Field(
        validation_alias=_node("cancel_grace_s"), default=5.0, gt=0,
        description="How long an abandoned stream waits for the daemon to confirm the cancel before the "
        "call is forgotten.",
    )  # fmt: skip
    pty_hangup_grace_s: tuple[float, ...] = Field(
        validation_alias=_node("pty_hangup_grace_s"), default=(0.5, 1.0, 2.0),
        description="After a PTY client vanished: how long to wait for its process to end after each "
        "SIGHUP (one SIGHUP per entry; JSON list in the environment).",
    )  # fmt: skip
    idempotency_memory: int = Field(
        validation_alias=_node("idempotency_memory"),
        default=1024,
        gt=0,
        description="Idempotency-Keys of snapshot and fork requests remembered.",
    )

    # -- the metrics history (space.node.agent.metrics, ADR 0053) --------------------------------------------
    metrics_interval_s: float = Field(
        validation_alias=_node("metrics_interval_s"), default=5.0, ge=0.1, le=3600.0,
        description="Seconds between two samples of every running sandbox's CPU, memory and disk.",
    )  # fmt: skip
    metrics_keep_s: float = Field(
        validation_alias=_node("metrics_keep_s"), default=3600.0, ge=1.0, le=7 * 86400.0,
        description="How much history each sandbox keeps (at most 8192 samples, whatever this says).",
    )  # fmt: skip

    # -- registration and heartbeat (space.node.agent.registration) ------------------------------------------
    heartbeat_interval_s: float = Field(
        validation_alias=_node("heartbeat_interval_s"),
        default=2.0,
        gt=0,
        description="Seconds between heartbeats (and between registration attempts).",
    )
    fence_without_helper: bool = Field(
        validation_alias=_node("fence_without_helper"), default=False,
        description="A node without a root helper (the fake driver, development only) enforces its lease "
        "(ADR 0033) on the agent's own loop, stopping its sandboxes when it ends. Off by default: fake "
        "sandboxes have no isolation to protect, and development clusters restart their control planes.",
    )  # fmt: skip
    control_plane_timeout_s: float = Field(
        validation_alias=_node("control_plane_timeout_s"),
        default=10.0,
        gt=0,
        description="Timeout of each request to the control plane.",
    )
