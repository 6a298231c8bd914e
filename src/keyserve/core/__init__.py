"""keyserve.core."""
