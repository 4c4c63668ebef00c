"""The node's storage: btrfs subvolumes, snapshots, quotas and send/receive (`btrfs`), the data-directory
filesystem (`filesystem`), templates (`templates`) and the apt mirror lookup (`mirror`).

Privileged: these modules are used by the root node helper only. Importing the package imports nothing.
"""
