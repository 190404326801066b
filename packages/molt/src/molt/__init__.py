"""molt."""
