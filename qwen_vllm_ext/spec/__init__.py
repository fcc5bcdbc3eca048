"""Speculative decoding (MTP) on hybrid Qwen models."""
