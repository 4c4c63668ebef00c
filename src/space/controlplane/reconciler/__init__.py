"""The reconciler: observed state toward desired state.

loop.py        the driver (leases, the claim loop, choosing and guarding each step): `Reconciler`
plan.py        which step follows which state, as data checked against space.core.lifecycle (pure)
context.py     what every step shares (store, nodes, object storage, data keys, the CAS transition)
creation.py    creating (a new sandbox, or a fork child on its parent's node)
suspension.py  suspending and restoring (through object storage)
recovery.py    recovering a crashed sandbox (local checkpoint, uploaded one, or a restart on its disk)
deletion.py    deleting, and collecting orphan copies on nodes
"""
