"""The root helper's fixed table of privileged verbs, and nothing else.

The table is the security boundary between the agent and root: a request names a verb of this table and
its arguments, which are parsed by the verb's model (space.node.helper.params) before its handler runs.
Handlers live by concern in node_verbs, template_verbs, sandbox_verbs, snapshot_verbs, network_verbs,
storage and transfer; what they share is in space.node.helper.context.

Invariants:
- A verb exists only if it is in VERBS. Its arguments are parsed by a pydantic model with extra fields
  forbidden; ids are checked against space.core.ids' patterns, names against the template pattern, and
  the only path argument is confined to the data directory. No argument ever reaches a shell.
- Every path is derived by NodeLayout from validated ids.
- Verbs on one sandbox are serialised by a per-sandbox lock, so two agents (or an agent and its restarted
  self) cannot interleave a checkpoint with a destroy.
- Each verb converges when repeated after a crash: "create" of an existing sandbox and "destroy" of a missing
  one report what is there instead of failing half-way.
"""

from __future__ import annotations

from space.node.helper import (
    fence_verbs,
    metrics_verbs,
    microvm_transfer,
    microvm_verbs,
    network_verbs,
    node_verbs,
    oci_image_verbs,
    sandbox_verbs,
    snapshot_verbs,
    staging,
    storage,
    template_build_verbs,
    template_travel_verbs,
    template_verbs,
    transfer,
)
from space.node.helper.context import Verb
from space.node.helper.fence_verbs import guarded
from space.node.helper.params import (
    AdoptWarmParams,
    CheckpointParams,
    ConfigureParams,
    CreateParams,
    DiskParams,
    ImportParams,
    NetworkConfigureParams,
    NoParams,
    NoTransferParams,
    ResetParams,
    RestoreParams,
    SandboxParams,
    SnapshotParams,
    StagingParams,
    StorageParams,
    TemplateClaimParams,
    TemplateCommitParams,
    TemplateParams,
    TemplateReceiveParams,
    TransferParams,
)

MICROVM_VERBS = (
    Verb("microvm.template_boot", microvm_verbs.MicrovmTemplateParams, guarded(microvm_verbs.template_boot)),
    Verb("microvm.template_adopt", microvm_verbs.MicrovmTemplateParams, microvm_verbs.template_adopt),
    Verb("microvm.template_status", microvm_verbs.MicrovmTemplateParams, microvm_verbs.template_status),
    Verb("microvm.create", microvm_verbs.MicrovmCreateParams, guarded(microvm_verbs.sandbox_create),
         sandbox_scoped=True),
    Verb("microvm.pause", SandboxParams, microvm_verbs.sandbox_pause, sandbox_scoped=True),
    Verb("microvm.resume", SandboxParams, guarded(microvm_verbs.sandbox_resume), sandbox_scoped=True),
    Verb("microvm.checkpoint", microvm_verbs.MicrovmCheckpointParams, microvm_verbs.sandbox_checkpoint,
         sandbox_scoped=True),
    Verb("microvm.restore", microvm_verbs.MicrovmRestoreParams, guarded(microvm_verbs.sandbox_restore),
         sandbox_scoped=True),
    Verb("microvm.start", SandboxParams, guarded(microvm_verbs.sandbox_start), sandbox_scoped=True),
    Verb("microvm.stop", SandboxParams, microvm_verbs.sandbox_stop, sandbox_scoped=True),
    Verb("microvm.destroy", SandboxParams, microvm_verbs.sandbox_destroy, sandbox_scoped=True),
    Verb("microvm.state", SandboxParams, microvm_verbs.sandbox_state),
    Verb("microvm.list", NoParams, microvm_verbs.sandbox_list),
    Verb("microvm.snapshot_list", SandboxParams, microvm_verbs.snapshot_list),
    Verb("microvm.snapshot_delete", microvm_verbs.MicrovmSnapshotParams, microvm_verbs.snapshot_delete,
         sandbox_scoped=True),
    # through object storage (space.node.helper.microvm_transfer, ADR 0081)
    Verb("microvm.export", microvm_transfer.MicrovmTransferParams, microvm_transfer.microvm_export,
         sandbox_scoped=True),
    Verb("microvm.import", microvm_transfer.MicrovmImportParams, microvm_transfer.microvm_import,
         sandbox_scoped=True),
)  # fmt: skip

VERBS: dict[str, Verb] = {
    verb.name: verb
    for verb in (
        Verb("node.prepare", NoParams, node_verbs.node_prepare),
        Verb("node.teardown", NoParams, node_verbs.node_teardown),
        Verb("template.ensure", TemplateParams, template_verbs.template_ensure),
        Verb("template.receive", TemplateReceiveParams, template_verbs.template_receive),
        Verb("template.warm_status", TemplateParams, template_verbs.template_warm_status),
        Verb("template.adopt_warm", AdoptWarmParams, template_verbs.template_adopt_warm),
        # user templates built in a sandbox (space.node.helper.template_build_verbs, ADR 0054)
        Verb("template.claim", TemplateClaimParams, template_build_verbs.template_claim),
        Verb("template.commit", TemplateCommitParams, template_build_verbs.template_commit),
        Verb("template.delete", TemplateParams, template_build_verbs.template_delete),
        Verb("template.list", NoParams, template_build_verbs.template_list),
        Verb("template.sources", NoParams, template_build_verbs.template_sources),
        # user templates from an OCI image archive, and travelling between nodes (ADR 0056)
        Verb("template.import_oci", oci_image_verbs.OciImportParams, oci_image_verbs.template_import_oci),
        Verb(
            "template.export",
            template_travel_verbs.TemplateTravelParams,
            template_travel_verbs.template_export,
        ),
        Verb(
            "template.import",
            template_travel_verbs.TemplateImportParams,
            template_travel_verbs.template_import,
        ),
        # the node's lease (space.node.helper.fence_verbs, docs/adr/0033-fencing.md); while the node is
        # fenced, the verbs that make a runtime run are refused (`guarded`)
        Verb("node.fence", fence_verbs.FenceParams, fence_verbs.node_fence),
        Verb("node.fence_status", NoParams, fence_verbs.node_fence_status),
        Verb("sandbox.create", CreateParams, guarded(sandbox_verbs.sandbox_create), sandbox_scoped=True),
        Verb("sandbox.configure", ConfigureParams, sandbox_verbs.sandbox_configure, sandbox_scoped=True),
        Verb("sandbox.start", SandboxParams, guarded(sandbox_verbs.sandbox_start), sandbox_scoped=True),
        Verb("sandbox.pause", SandboxParams, sandbox_verbs.sandbox_pause, sandbox_scoped=True),
        Verb("sandbox.resume", SandboxParams, guarded(sandbox_verbs.sandbox_resume), sandbox_scoped=True),
        Verb("sandbox.stop", SandboxParams, sandbox_verbs.sandbox_stop, sandbox_scoped=True),
        Verb("sandbox.discard", SandboxParams, sandbox_verbs.sandbox_discard, sandbox_scoped=True),
        Verb("sandbox.checkpoint", CheckpointParams, snapshot_verbs.sandbox_checkpoint, sandbox_scoped=True),
        Verb("sandbox.restore", RestoreParams, guarded(snapshot_verbs.sandbox_restore), sandbox_scoped=True),
        Verb(
            "sandbox.disk_snapshot", SnapshotParams, snapshot_verbs.sandbox_disk_snapshot, sandbox_scoped=True
        ),
        Verb("sandbox.reset_rootfs", ResetParams, snapshot_verbs.sandbox_reset_rootfs, sandbox_scoped=True),
        Verb("sandbox.destroy", SandboxParams, sandbox_verbs.sandbox_destroy, sandbox_scoped=True),
        Verb("sandbox.state", SandboxParams, sandbox_verbs.sandbox_state),
        Verb("sandbox.usage", SandboxParams, sandbox_verbs.sandbox_usage),
        # one read of many running sandboxes' counters per tick of the metrics history (ADR 0053)
        Verb("sandbox.metrics", metrics_verbs.MetricsParams, metrics_verbs.sandbox_metrics),
        # disk budgets (space.node.helper.storage, docs/adr/0027-disk-budgets.md)
        Verb("sandbox.storage", StorageParams, storage.sandbox_storage),
        Verb("node.disk", DiskParams, storage.node_disk),
        Verb("sandbox.list", NoParams, sandbox_verbs.sandbox_list),
        Verb("snapshot.delete", SnapshotParams, snapshot_verbs.snapshot_delete, sandbox_scoped=True),
        Verb("snapshot.usage", SnapshotParams, snapshot_verbs.snapshot_usage),
        Verb("snapshot.list", SandboxParams, snapshot_verbs.snapshot_list),
        # per-sandbox network namespaces and the node's nftables table (space.node.helper.network)
        Verb("sandbox.network", SandboxParams, network_verbs.verb_sandbox_network),
        Verb("network.info", NoParams, network_verbs.verb_network_info),
        Verb("network.configure", NetworkConfigureParams, network_verbs.verb_network_configure),
        # suspend / restore / templates through object storage (space.node.helper.transfer)
        Verb("snapshot.export", TransferParams, transfer.snapshot_export, sandbox_scoped=True),
        Verb("snapshot.import", ImportParams, transfer.snapshot_import, sandbox_scoped=True),
        Verb("staging.prepare", StagingParams, staging.staging_prepare, sandbox_scoped=True),
        Verb("staging.release", StagingParams, staging.staging_release, sandbox_scoped=True),
        Verb("template.base_status", NoTransferParams, transfer.base_status),
        Verb("template.base_export", NoTransferParams, transfer.base_export),
        Verb("template.base_import", NoTransferParams, transfer.base_import),
        # microVM sandboxes: the qemu driver (space.node.helper.microvm_verbs, ADR 0068)
        *MICROVM_VERBS,
    )
}
