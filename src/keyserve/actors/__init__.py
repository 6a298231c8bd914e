"""keyserve.actors."""
