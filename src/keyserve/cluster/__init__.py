"""keyserve.cluster."""
