"""rlestimators."""
