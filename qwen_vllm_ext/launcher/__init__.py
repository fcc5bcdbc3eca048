"""What the launcher (``python -m qwen_vllm_ext.serve``) and the fleet need besides vLLM: GPU detection."""
