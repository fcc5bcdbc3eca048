"""Many replicas of ``python -m qwen_vllm_ext.serve`` behind vLLM's router (``vllm-router``) with one shared Redis.

* :mod:`.plan` -- pure: the fleet's configuration, its checks and every command line (``--print-command``);
* :mod:`.processes` -- starting, watching and stopping the processes (Redis, replicas, router);
* :mod:`.__main__` -- ``python -m qwen_vllm_ext.fleet``.
"""
