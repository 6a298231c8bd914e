"""keyserve.engine."""
