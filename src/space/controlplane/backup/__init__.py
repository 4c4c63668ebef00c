"""Backups of the control plane's state (ADR 0062): `archive` (the format and its verified reading),
`engines` (SQLite's online backup, pg_dump/pg_restore, whether a target is in use), `state` (what a backup
holds, create and restore)."""
