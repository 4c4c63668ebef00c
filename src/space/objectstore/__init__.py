"""objectstore."""
