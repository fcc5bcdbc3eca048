"""What ``nvidia-smi`` prints for the GPUs the hardware profiles are tested on (one CSV line each: index, name,
memory in MiB, MIG mode), for the ``fake_nvidia_smi`` fixture of tests/conftest.py."""

NVIDIA_SMI_LINES = {
    "a100-80gb": "0, NVIDIA A100-SXM4-80GB, 81920, [N/A]",
    "a100-40gb": "0, NVIDIA A100-SXM4-40GB, 40960, [N/A]",
    "a100-mig": "0, NVIDIA A100-SXM4-80GB, 81920, Enabled",
    "h100-80gb": "0, NVIDIA H100 80GB HBM3, 81559, Disabled",
    "h200-141gb": "0, NVIDIA H200, 143771, Disabled",
    "l4": "0, NVIDIA L4, 23034, [N/A]",
}
