"""keyserve.model."""
