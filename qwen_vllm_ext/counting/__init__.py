"""Exact token counting on the server: ``POST /v1/tokens/count`` and the served model's calculator
(:mod:`.server`: the route and its start-up state)."""
