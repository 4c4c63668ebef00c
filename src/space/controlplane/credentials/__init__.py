"""The control plane's credential store: vault backends for values (vault.py), validation of metadata and
egress policies (spec.py). Metadata, bindings and the audit log live in the SQL store
(space.controlplane.store.credentials); the HTTP routes are space.controlplane.api.credentials.

Invariant: a credential's value leaves the control plane only to a node running a sandbox bound to it
(GET /v1/nodes/{node}/sandboxes/{sandbox}/credentials), never in an answer to a tenant.
"""

from space.controlplane.credentials.vault import (
    DirectoryBlobs,
    EncryptedLocalVault,
    SealedBlobs,
    VaultBackend,
)

__all__ = ["DirectoryBlobs", "EncryptedLocalVault", "SealedBlobs", "VaultBackend"]
