"""Object storage for templates, suspended sandboxes and checkpoints: a local directory or S3.

`base` defines the interface, `backends.open_store(url)` opens a store by URL; `artifacts` defines the stored
format (parts + manifest).

Invariant: every backend failure reaches callers as a typed space.core.errors error, and an artifact is
restorable exactly when its manifest (written last) exists. Imports only space.core and space.crypto.
"""

from space.objectstore.backends import open_store
from space.objectstore.base import ObjectStore

__all__ = ["ObjectStore", "open_store"]
