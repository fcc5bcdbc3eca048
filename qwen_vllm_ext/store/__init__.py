"""Storage shared by the capabilities (ledger, API keys, limiter): no vLLM, no capability imports.

* :mod:`.sqlite` -- one SQLite connection set-up: pragmas, fork safety, ``BEGIN IMMEDIATE`` transactions.
* :mod:`.redis` -- the one way to connect to Redis (fail loudly, never retry silently).
* :mod:`.locations` -- which backend and which file or URL each store uses, from the settings.
"""
