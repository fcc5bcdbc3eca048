"""KV-cache reuse across chat turns: prefix-stable template selection and per-conversation reuse ratios
(:mod:`.reuse`), idle sleep of the engine (:mod:`.sleep`), both pure; :mod:`.server` is the vLLM glue."""
