"""The reconciler: observed state toward desired state."""
