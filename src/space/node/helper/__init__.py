"""helper."""
