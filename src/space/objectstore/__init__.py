"""Object storage for templates, suspended sandboxes and checkpoints: a local directory or S3.

`base` defines the interface and `open_store(url)`; `artifacts` defines the stored format (parts + manifest).

Invariant: every backend failure reaches callers as a typed space.core.errors error, and an artifact is
restorable exactly when its manifest (written last) exists. Imports only space.core and space.crypto.
"""

from space.objectstore.base import ObjectStore, open_store

__all__ = ["ObjectStore", "open_store"]
