"""Sampling fixes in the engine's workers: what a request's sampling parameters must never do to the engine."""
