"""Launch profiles: data files (``<name>.toml`` next to this module), their selection and checks.

A profile has four tables: ``[profile]`` (description, device, GPU names it is for, GPU memory it needs),
``[vllm]`` (flags for vLLM; the user's own flags override them), ``[env]`` (environment defaults; the
user's environment wins) and ``[extension]`` (defaults for :class:`qwen_vllm_ext.config.Settings`).
Pure Python: selection is tested with fake GPUs.
"""
from __future__ import annotations

import dataclasses
import json

try:
    import tomllib  # novermin (3.11+; the except branch covers 3.10)
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib
from pathlib import Path
from typing import Any

from ..launcher.hardware import GPU

PROFILE_DIR = Path(__file__).resolve().parent


class ProfileError(ValueError):
    """The launcher refuses: unknown profile, wrong or missing hardware."""


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    device: str
    gpu_names: tuple[str, ...]
    min_gpu_memory_gib: float
    vllm: dict[str, Any]
    env: dict[str, str]
    extension: dict[str, Any]

    def matches(self, gpu: GPU) -> bool:
        return any(n.lower() in gpu.name.lower() for n in self.gpu_names)

    def vllm_argv(self, skip_dests: set[str], dest_of) -> list[str]:
        """The profile's flags as argv, leaving out every flag whose destination the user already set."""
        argv = []
        for flag, value in self.vllm.items():
            if dest_of("--" + flag) in skip_dests:
                continue
            if value is True:
                argv.append(f"--{flag}")
            elif value is False:
                argv.append(f"--no-{flag}")
            elif isinstance(value, (dict, list)):
                argv += [f"--{flag}", json.dumps(value)]
            else:
                argv += [f"--{flag}", str(value)]
        return argv


def load_profile(name: str) -> Profile:
    path = PROFILE_DIR / f"{name}.toml"
    if not path.is_file():
        raise ProfileError(f"unknown profile {name!r}; known profiles: {', '.join(profile_names())}")
    data = tomllib.loads(path.read_text())
    meta = data.get("profile", {})
    return Profile(
        name=name,
        description=meta.get("description", ""),
        device=meta.get("device", "cuda"),
        gpu_names=tuple(meta.get("gpu_names", ())),
        min_gpu_memory_gib=float(meta.get("min_gpu_memory_gib", 0)),
        vllm=dict(data.get("vllm", {})),
        env={k: str(v) for k, v in data.get("env", {}).items()},
        extension=dict(data.get("extension", {})),
    )


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def all_profiles() -> list[Profile]:
    return [load_profile(n) for n in profile_names()]


def check_hardware(profile: Profile, gpus: list[GPU]) -> None:
    """Refuse (ProfileError) when the visible GPUs cannot run ``profile``."""
    if profile.device != "cuda":
        return
    if not gpus:
        raise ProfileError(
            f"profile {profile.name!r} needs an NVIDIA GPU ({', '.join(profile.gpu_names)}) but nvidia-smi "
            f"shows none; use --profile cpu, or --print-command to only see the flags"
        )
    for gpu in gpus:
        if gpu.mig_enabled:
            raise ProfileError(
                f"GPU {gpu.index} ({gpu.name}) has MIG enabled; MIG slices cost over 40% throughput for this "
                f"workload. Disable it (`sudo nvidia-smi -i {gpu.index} -mig 0`, then reset the GPU) or expose "
                f"a non-MIG GPU with CUDA_VISIBLE_DEVICES"
            )
        if gpu.memory_gib < profile.min_gpu_memory_gib:
            raise ProfileError(
                f"GPU {gpu.index} ({gpu.name}) has {gpu.memory_gib:.1f} GiB; profile {profile.name!r} needs "
                f"{profile.min_gpu_memory_gib:g} GiB. Use a GPU with enough memory, or choose another profile with "
                f"--profile NAME and lower --max-model-len / --max-num-seqs until the model fits"
            )


def select_profile(gpus: list[GPU], requested: str | None = None) -> Profile:
    """The profile to use: the requested one, else the one made for the detected GPU, else ``cpu``."""
    if requested:
        return load_profile(requested)
    if not gpus:
        return load_profile("cpu")
    gpu = gpus[0]
    candidates = [p for p in all_profiles() if p.device == "cuda" and p.matches(gpu)]
    if not candidates:
        raise ProfileError(
            f"no profile is made for GPU {gpu.name!r} ({gpu.memory_gib:.1f} GiB); pick one with --profile NAME "
            f"(known profiles: {', '.join(profile_names())})"
        )
    fitting = [p for p in candidates if gpu.memory_gib >= p.min_gpu_memory_gib]
    # Prefer the most demanding profile that fits; if none fits, return the closest and let the
    # hardware check explain the memory shortfall.
    return max(fitting or candidates, key=lambda p: p.min_gpu_memory_gib if fitting else -p.min_gpu_memory_gib)
