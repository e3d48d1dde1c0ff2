"""Shared memory: segments, mappings, limits, the consumer's slots and the workers' writer."""
