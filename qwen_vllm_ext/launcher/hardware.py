"""GPU detection through ``nvidia-smi``, and splitting CPU cores (pure Python; no CUDA, torch or vLLM import).

``QWEN_VLLM_EXT_NVIDIA_SMI`` names the binary to run (default ``nvidia-smi`` on PATH), which is also how
tests fake a GPU.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

QUERY = "index,name,memory.total,mig.mode.current"


@dataclasses.dataclass(frozen=True)
class GPU:
    index: int
    name: str
    memory_mib: int
    mig_enabled: bool

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


def parse_nvidia_smi(text: str) -> list[GPU]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,mig.mode.current --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        index, name, memory, mig = fields
        gpus.append(GPU(int(index), name, int(float(memory)), mig.lower() == "enabled"))
    return gpus


def detect_gpus(environ=None) -> list[GPU]:
    """GPUs visible to this process ([] when there is no NVIDIA driver)."""
    environ = os.environ if environ is None else environ
    binary = environ.get("QWEN_VLLM_EXT_NVIDIA_SMI") or shutil.which("nvidia-smi")
    if not binary:
        return []
    try:
        out = subprocess.run(
            [binary, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = parse_nvidia_smi(out)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        wanted = [int(v) for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if g.index in wanted]
    return gpus


def split_cores(cores, n: int) -> list[list[int]]:
    """``cores`` (sorted) in ``n`` contiguous, nearly equal parts -- one per replica or data-parallel engine."""
    cores = sorted(cores)
    size, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(cores[start:end])
        start = end
    return out
