"""Which processes of one server loaded the extension, and in what state (pure Python, no vLLM).

vLLM spawns its engine core and workers as separate processes, so "the plugin is loaded" is a
per-process fact. The general plugin writes one small JSON record per process into the server
instance's directory; the health route reads them all. The directory is chosen by the first process
(the launcher or vLLM's API server) and inherited by every child through ``QWEN_VLLM_EXT_INSTANCE_DIR``.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

INSTANCE_ENV = "QWEN_VLLM_EXT_INSTANCE_DIR"
LAUNCH_ENV = "QWEN_VLLM_EXT_LAUNCH"
"""What the launcher chose and saw (JSON: profile, detected GPUs), inherited by every vLLM process."""


def instance_dir(create: bool = True) -> Path | None:
    path = os.environ.get(INSTANCE_ENV)
    if path:
        return Path(path)
    if not create:
        return None
    path = tempfile.mkdtemp(prefix="qwen-vllm-ext-")
    os.environ[INSTANCE_ENV] = path  # inherited by every process spawned from here on
    return Path(path)


def process_role(name: str | None = None) -> str:
    """Classify a multiprocessing process name as vLLM names them."""
    name = name if name is not None else multiprocessing.current_process().name
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    if name == "MainProcess" or "ApiServer" in name:
        return "api_server"
    return "other"


def write_json(name: str, data: dict) -> Path:
    """Atomically write ``data`` as ``name`` in the instance directory."""
    directory = instance_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)
    return path


def record_process(state: dict) -> Path:
    """Write this process's record; returns its path."""
    name = multiprocessing.current_process().name
    record = {"pid": os.getpid(), "process": name, "role": process_role(name), "time": time.time(), **state}
    return write_json(f"process-{os.getpid()}.json", record)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_processes(pattern: str = "process-*.json") -> list[dict]:
    """Records (files matching ``pattern``) of live processes of this instance (dead ones are skipped)."""
    directory = instance_dir(create=False)
    if directory is None or not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob(pattern)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(record.get("pid", -1))):
            records.append(record)
    return records
