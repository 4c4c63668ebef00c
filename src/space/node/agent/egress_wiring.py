"""The node's egress wiring: one EgressGateway per node agent, fed with every sandbox's source address and
policy, and every sandbox prepared to use it (proxy variables, the node's CA in its trust store, DNS).

Only active when the node's helper runs with `network = "sandbox"` (asked through `network.info`); with
"none" nothing here is installed and the agent behaves exactly as without it.

How it hooks in: `install()` wraps the agent's driver in `EgressDriver`, which sees every moment a
sandbox's runtime comes up (create incl. warm start and the binding of a pooled runtime, start, restore:
rollback, fork children, restore from object storage, recovery; connect after an agent restart; a
keep-running checkpoint that replaced the runtime) and every moment it goes (stop, destroy). So no
lifecycle path can bring a sandbox up without its policy being decided first.

Invariants:
- Fail closed: a sandbox whose policy is unknown (no record, control plane unreachable) is not known to
  the gateway, so it has no egress at all. A sandbox is only handed out after its policy was applied and
  its files were written; if either fails, the lifecycle step fails.
- With a control plane, a sandbox's policy is the control plane's (`ControlPlaneCredentials.policy`; it
  resolves fork children to their parent's policy itself); the node's record of the last push (PUT
  /sandboxes/{id}/egress, newer versions only, persisted in `state_dir`) is used when it is newer or the
  control plane cannot be asked. Without one, the node's record (create request or push) is the policy,
  and a fork child without a record takes its parent's.
- What a sandbox sees of the gateway does not depend on the node: the proxy is `http://<sandbox gateway
  address>:<proxy port>` (the same inner address in every sandbox, and fixed ports by default), so the
  environment set at create stays right after restore or fork elsewhere. The CA differs per node: every
  time a runtime starts or is restored (fresh files), the node's CA is written into the sandbox's trust
  store again (the block between the SPACE markers is replaced), and resolv.conf points at the gateway.
- No credential value ever passes through here: the sandbox gets placeholders only (put into its env by
  the control plane, or by the caller of a node-only create); the gateway fetches values itself.

Beside this module: egress_settings (operator settings, the policy as callers send it), egress_sandbox
(what a sandbox must contain), egress_records (the node's persisted record of policies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import httpx

from space.core import errors
from space.node.agent import egress_sandbox
from space.node.agent.channel import GuestChannel
from space.node.agent.credential_manager import AuditForwarder, ControlPlaneCredentials
from space.node.agent.egress_records import PolicyRecord, load_records, save_records
from space.node.agent.egress_settings import EgressRequest, EgressSettings
from space.node.agent.guest import GuestSession
from space.node.agent.identity import IdentityAuth, NodeIdentity
from space.node.drivers.base import CheckpointInfo, Driver, SandboxSpec
from space.node.egress import CredentialSource, EgressGateway, EgressPolicy, StaticCredentials

if TYPE_CHECKING:
    from space.node.agent.agent import NodeAgent
    from space.node.agent.helper_client import HelperClient

log = logging.getLogger(__name__)

RECENT_AUDIT = 1000
CP_POLICY_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)


class EgressWiring:
    """The node agent's egress side: the gateway, sandbox policies, and what a sandbox must contain."""

    def __init__(
        self,
        helper: HelperClient,
        gateway: EgressGateway,
        network_info: Mapping[str, Any],
        state_dir: pathlib.Path,
        *,
        control_plane: ControlPlaneCredentials | None = None,
        audit_forwarder: AuditForwarder | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.helper = helper
        self.gateway = gateway
        self.network_info = dict(network_info)
        self.state_dir = state_dir
        self.control_plane = control_plane
        self.audit_forwarder = audit_forwarder
        self._http = http
        self._records: dict[str, PolicyRecord] = load_records(state_dir)
        self._sources: dict[str, str] = {}  # sandbox id -> host-side address, while its runtime is up
        self._retries: dict[str, asyncio.Task[None]] = {}
        self.recent_audit: deque[dict[str, Any]] = deque(maxlen=RECENT_AUDIT)

    # -- gateway lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.gateway.start()
        ports = self.gateway.ports
        configured = await self.helper.call("network.configure", {"ports": ports})
        self.network_info.update(configured)
        if self.audit_forwarder is not None:
            self.audit_forwarder.start()
        log.info("egress gateway on %s ports %s", self.gateway.listen_host, ports)

    async def close(self) -> None:
        for task in self._retries.values():
            task.cancel()
        self._retries.clear()
        await self.gateway.close()
        if self.audit_forwarder is not None:
            await self.audit_forwarder.close()
        if self._http is not None:
            await self._http.aclose()

    def audit(self, record: dict[str, Any]) -> None:
        """The gateway's audit callback: keep recent events here, forward to the control plane if any."""
        self.recent_audit.append(record)
        if self.audit_forwarder is not None:
            self.audit_forwarder(record)
        elif record.get("decision") not in {"allowed", "answered"}:
            log.info("egress %s", record)

    # -- what a sandbox sees -------------------------------------------------------------------------------
    @property
    def sandbox_gateway_addr(self) -> str:
        return str(self.network_info["sandbox_gateway_addr"])

    @property
    def proxy_url(self) -> str:
        return f"http://{self.sandbox_gateway_addr}:{self.gateway.ports['proxy']}"

    def sandbox_env(self) -> dict[str, str]:
        """Environment every sandbox of this node gets (the same on every node with the default ports)."""
        return egress_sandbox.sandbox_env(self.proxy_url)

    async def install_files(self, session: GuestSession) -> None:
        """The node's CA into the sandbox's trust store (replacing another node's), DNS to the gateway."""
        await egress_sandbox.install_files(
            session, self.gateway.ca_certificate_pem, self.sandbox_gateway_addr
        )

    # -- policies ------------------------------------------------------------------------------------------
    def remember(self, sandbox_id: str, policy: EgressRequest, credentials: Sequence[str] = ()) -> None:
        """Record the policy a sandbox is created with (applied when its runtime comes up)."""
        self._records[sandbox_id] = PolicyRecord(policy, list(credentials))
        save_records(self.state_dir, self._records)

    def recorded(self, sandbox_id: str) -> EgressRequest | None:
        record = self._records.get(sandbox_id)
        return record.policy if record else None

    async def apply(
        self, sandbox_id: str, policy: EgressRequest, credentials: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """A policy change at run time: recorded (newer versions only), credentials fetched again, and in
        force at once if the sandbox runs."""
        known = self._records.get(sandbox_id)
        if known is not None and policy.version and known.policy.version > policy.version:
            return {"applied": False, "reason": "stale", "version": known.policy.version}
        compiled = self._policy(policy)
        names = list(credentials) if credentials is not None else (known.credentials if known else [])
        self._records[sandbox_id] = PolicyRecord(policy, names)
        save_records(self.state_dir, self._records)
        if self.control_plane is not None:
            self.control_plane.forget(sandbox_id)  # bindings may have changed: fetch them again
        source = self._sources.get(sandbox_id)
        if source is not None:
            self._set(sandbox_id, source, compiled)
        return {"applied": True, "live": source is not None, "version": policy.version}

    def _policy(self, request: EgressRequest) -> EgressPolicy:
        """With a control plane, private ranges open only inside what it says the org approved."""
        return request.policy(approvals_required=self.control_plane is not None)

    async def _policy_for(self, sandbox_id: str, source_sandbox_id: str | None) -> EgressPolicy | None:
        if self.control_plane is not None:
            return await self._control_plane_policy(self.control_plane, sandbox_id)
        record = self._records.get(sandbox_id)
        if record is not None:
            return record.policy.policy()
        if source_sandbox_id is not None and source_sandbox_id != sandbox_id:
            parent = self._records.get(source_sandbox_id)
            if parent is not None:
                self.remember(sandbox_id, parent.policy, parent.credentials)
                return parent.policy.policy()
        return None

    async def _control_plane_policy(
        self, control_plane: ControlPlaneCredentials, sandbox_id: str
    ) -> EgressPolicy | None:
        """The control plane is the truth (it also resolves fork children to their parent's policy); the
        node's record is the last push, used when it is newer or the control plane cannot be asked."""
        record = self._records.get(sandbox_id)
        try:
            found = await control_plane.policy(sandbox_id)
        except errors.SpaceError as exc:
            if record is not None:
                return self._policy(record.policy)
            log.warning("egress policy of %s unavailable (no egress until it is): %s", sandbox_id,
                        exc.message)  # fmt: skip
            self._retry_later(sandbox_id)
            return None
        version = int(found.get("version") or 0)
        if record is not None and record.policy.version > version:
            return self._policy(record.policy)
        allow, deny = list(found.get("allow") or []), list(found.get("deny") or [])
        approved = list(found.get("private_networks") or [])
        if allow or deny or version:
            return self._policy(
                EgressRequest(allow=allow, deny=deny, version=version, private_networks=approved)
            )
        return self._policy(record.policy) if record is not None else None

    def _retry_later(self, sandbox_id: str) -> None:
        if sandbox_id in self._retries:
            return

        async def retry() -> None:
            try:
                for delay in CP_POLICY_RETRY_S:
                    await asyncio.sleep(delay)
                    source = self._sources.get(sandbox_id)
                    if source is None or self.control_plane is None:
                        return
                    with contextlib.suppress(errors.SpaceError):
                        found = await self.control_plane.policy(sandbox_id)
                        approved = list(found.get("private_networks") or [])
                        policy = EgressRequest(allow=list(found.get("allow") or []),
                                               deny=list(found.get("deny") or []),
                                               private_networks=approved)  # fmt: skip
                        if sandbox_id not in self._records and self._sources.get(sandbox_id) == source:
                            self._set(sandbox_id, source, self._policy(policy))
                        return
            finally:
                self._retries.pop(sandbox_id, None)

        self._retries[sandbox_id] = asyncio.get_running_loop().create_task(retry())

    def _claim_source(self, sandbox_id: str, source: str) -> None:
        # The helper's record is the truth about who owns a host address now: a stale claim (a sandbox this
        # agent did not see go) gives way.
        for other, addr in list(self._sources.items()):
            if addr == source and other != sandbox_id:
                self.gateway.forget(other)
                self._sources.pop(other, None)

    def _set(self, sandbox_id: str, source: str, policy: EgressPolicy) -> None:
        self._claim_source(sandbox_id, source)
        try:
            self.gateway.set_policy(sandbox_id, source, policy)
        except errors.Conflict:
            owner = self.gateway.ctx.by_source.get(source)
            if owner is None or owner == sandbox_id:
                raise
            self.gateway.forget(owner)
            self.gateway.set_policy(sandbox_id, source, policy)
        self._sources[sandbox_id] = source

    # -- sandbox events (from EgressDriver) ----------------------------------------------------------------
    async def runtime_up(
        self,
        sandbox_id: str,
        channel: GuestChannel | None,
        *,
        fresh: bool,
        source_sandbox_id: str | None = None,
    ) -> None:
        """A sandbox's runtime is (again) up: its policy in force at the gateway; with `fresh` (a boot or a
        restore, possibly from another node) its trust store, DNS and proxy environment written too."""
        network = await self.helper.call("sandbox.network", {"sandbox_id": sandbox_id})
        source = str(network["host_addr"])
        policy = await self._policy_for(sandbox_id, source_sandbox_id)
        if policy is None:
            self.gateway.forget(sandbox_id)
            self._claim_source(sandbox_id, source)
            self._sources[sandbox_id] = source
        else:
            self._set(sandbox_id, source, policy)
        if fresh and channel is not None:
            session = GuestSession(channel)
            await self.install_files(session)
            await session.configure(self.sandbox_env())

    def runtime_gone(self, sandbox_id: str) -> None:
        self.gateway.forget(sandbox_id)
        self._sources.pop(sandbox_id, None)
        if self.control_plane is not None:
            self.control_plane.forget(sandbox_id)

    def sandbox_deleted(self, sandbox_id: str) -> None:
        self.runtime_gone(sandbox_id)
        if self._records.pop(sandbox_id, None) is not None:
            save_records(self.state_dir, self._records)


class EgressDriver:
    """The agent's driver, seen through the egress wiring: every runtime that comes up gets its policy (and
    on a boot or restore its files) before the agent hands it out; every runtime that goes is forgotten.
    Everything else is the wrapped driver's, unchanged."""

    def __init__(self, inner: Driver, wiring: EgressWiring) -> None:
        self.inner = inner
        self.wiring = wiring

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def create(self, spec: SandboxSpec) -> None:
        spec.env.update(self.wiring.sandbox_env())
        await self.inner.create(spec)

    async def create_warm(self, spec: SandboxSpec) -> GuestChannel | None:
        spec.env.update(self.wiring.sandbox_env())
        channel = await self.inner.create_warm(spec)
        if channel is not None:
            await self.wiring.runtime_up(spec.sandbox_id, channel, fresh=True)
        return channel

    async def create_pooled(self, spec: SandboxSpec) -> GuestChannel:
        # Nobody's yet: what every sandbox of this node gets (proxy environment, the node's CA, DNS), and no
        # policy at all (no egress) until it is bound.
        spec.env.update(self.wiring.sandbox_env())
        channel = await self.inner.create_pooled(spec)
        session = GuestSession(channel)
        await self.wiring.install_files(session)
        await session.configure(self.wiring.sandbox_env())
        return channel

    async def bind_pooled(self, spec: SandboxSpec, channel: GuestChannel) -> None:
        spec.env.update(self.wiring.sandbox_env())
        async with asyncio.TaskGroup() as steps:
            steps.create_task(self.inner.bind_pooled(spec, channel))
            steps.create_task(self.wiring.runtime_up(spec.sandbox_id, channel, fresh=False))

    async def start(self, sandbox_id: str) -> GuestChannel:
        channel = await self.inner.start(sandbox_id)
        await self.wiring.runtime_up(sandbox_id, channel, fresh=True)
        return channel

    async def connect(self, sandbox_id: str) -> GuestChannel:
        channel = await self.inner.connect(sandbox_id)
        await self.wiring.runtime_up(sandbox_id, channel, fresh=False)
        return channel

    async def restore(
        self, sandbox_id: str, snapshot_id: str, *, source_sandbox_id: str | None = None, limits: Any = None
    ) -> GuestChannel:
        channel = await self.inner.restore(
            sandbox_id, snapshot_id, source_sandbox_id=source_sandbox_id, limits=limits
        )
        await self.wiring.runtime_up(sandbox_id, channel, fresh=True, source_sandbox_id=source_sandbox_id)
        return channel

    async def checkpoint(
        self, sandbox_id: str, snapshot_id: str, *, keep_running: bool = True, leave_paused: bool = False
    ) -> tuple[CheckpointInfo, GuestChannel | None]:
        info, channel = await self.inner.checkpoint(
            sandbox_id, snapshot_id, keep_running=keep_running, leave_paused=leave_paused
        )
        if channel is not None:
            await self.wiring.runtime_up(sandbox_id, channel, fresh=False)
        return info, channel

    async def stop(self, sandbox_id: str) -> None:
        self.wiring.runtime_gone(sandbox_id)
        await self.inner.stop(sandbox_id)

    async def discard(self, sandbox_id: str) -> None:
        self.wiring.runtime_gone(sandbox_id)
        await self.inner.discard(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        self.wiring.sandbox_deleted(sandbox_id)
        await self.inner.destroy(sandbox_id)

    async def close(self) -> None:
        try:
            await self.wiring.close()
        finally:
            await self.inner.close()


# -- installation ------------------------------------------------------------------------------------------
async def install(
    agent: NodeAgent,
    settings: EgressSettings,
    *,
    control_plane: str | None = None,
    identity: NodeIdentity | None = None,
) -> EgressWiring | None:
    """Give `agent` its egress gateway if its node gives sandboxes a network; None (nothing changed) when
    the node's network is "none", the driver's sandboxes have no network or the driver has no helper. Call
    after the node is prepared and before `agent.recover()`, so that adopted sandboxes get their policies
    too."""
    if isinstance(agent.driver, EgressDriver):
        return agent.driver.wiring
    if not getattr(agent.driver, "networked", True):
        # A driver whose sandboxes have no network device (the qemu driver's microVMs: ADR 0068, 0076) has
        # nothing to send through a gateway, and its sandboxes no network slot to ask the helper about.
        log.info("%s sandboxes have no network: no egress gateway on this node", agent.driver.name)
        return None
    helper = cast("HelperClient | None", getattr(agent.driver, "helper", None))
    if helper is None:
        return None
    info = await helper.call("network.info")
    if info.get("mode") != "sandbox":
        return None
    try:
        settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = settings.state_dir / ".writable"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise errors.Unavailable(
            f"the egress gateway's state directory {settings.state_dir} is not usable by this user ({exc}); "
            "create it owned by the agent's user (the node helper's node.prepare does)"
        ) from exc
    http: httpx.AsyncClient | None = None
    cp_credentials: ControlPlaneCredentials | None = None
    forwarder: AuditForwarder | None = None
    credentials: CredentialSource
    if control_plane:
        if identity is None:
            raise errors.InvalidArgument(
                "a control plane needs the node's identity (space.node.agent.identity)"
            )
        # The node's per-node identity, read per request: valid after each (re-)registration (ADR 0019).
        http = httpx.AsyncClient(
            base_url=control_plane.rstrip("/"), auth=IdentityAuth(identity), timeout=10.0
        )
        cp_credentials = ControlPlaneCredentials(http, identity.current_node_id)
        forwarder = AuditForwarder(http, identity.current_node_id)
        credentials = cp_credentials
    else:
        credentials = settings.credentials or StaticCredentials()
    wiring_ref: list[EgressWiring] = []

    def audit(record: dict[str, Any]) -> None:
        if wiring_ref:
            wiring_ref[0].audit(record)

    gateway = EgressGateway(
        ca_dir=settings.state_dir / "ca",
        credentials=credentials,
        audit=audit,
        resolver=settings.resolver,
        listen_host=str(info["gateway_addr"]),
        listen_ports=settings.ports,
        trust_store=settings.trust_store,
        operator_allowed_networks=settings.operator_allowed_networks,
    )
    wiring = EgressWiring(
        helper, gateway, info, settings.state_dir, control_plane=cp_credentials, audit_forwarder=forwarder,
        http=http,
    )  # fmt: skip
    wiring_ref.append(wiring)
    try:
        await wiring.start()
    except BaseException:
        await wiring.close()
        raise
    agent.driver = cast(Driver, EgressDriver(agent.driver, wiring))
    return wiring


def wiring_of(agent: NodeAgent) -> EgressWiring | None:
    driver: object = agent.driver
    return driver.wiring if isinstance(driver, EgressDriver) else None
