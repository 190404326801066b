"""asyncpool."""
