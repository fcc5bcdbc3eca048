"""In-server gateway: scoped API keys, rate limits, budgets, headers and errors (pure Python)."""
