"""``python -m qwen_vllm_ext.patches``: the source-patch command (see :mod:`qwen_vllm_ext.sourcepatch`)."""
from ..sourcepatch.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
