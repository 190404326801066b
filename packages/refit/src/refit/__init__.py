"""refit."""
