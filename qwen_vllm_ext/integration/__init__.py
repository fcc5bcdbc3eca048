"""How the extension plugs into vLLM (the only layer that imports the capabilities' wiring).

* :mod:`.plugin`           vLLM's entry points (general plugin in every process, endpoint plugin in API servers)
* :mod:`.runtime_patches`  the one list of runtime patches and the settings that turn them on
* :mod:`.guard`            fingerprints of the vLLM functions a runtime patch wraps; the startup guard
* :mod:`.stack`            the ASGI middlewares of an API-server process, in one declared order
* :mod:`.hooks`            the functions a source-patched vLLM calls (same code path as the plugin)

Imports run one way: integration -> capabilities (scheduling, usage, gateway, kv) -> store and pure cores.
"""
