"""GPU detection (fake nvidia-smi) and profile selection/refusals: pure Python, no vLLM."""
import dataclasses
from pathlib import Path

import pytest

from qwen_vllm_ext.launcher.hardware import GPU, detect_gpus, parse_nvidia_smi
from qwen_vllm_ext.profiles import ProfileError, check_hardware, load_profile, profile_names, select_profile

from ..helpers.hardware import NVIDIA_SMI_LINES


def gpus_for(kind):
    return parse_nvidia_smi(NVIDIA_SMI_LINES[kind])


def test_parse_nvidia_smi_fields_and_mig():
    gpus = parse_nvidia_smi(NVIDIA_SMI_LINES["a100-80gb"] + "\n" + NVIDIA_SMI_LINES["a100-mig"].replace("0,", "1,", 1) + "\n")
    assert gpus == [GPU(0, "NVIDIA A100-SXM4-80GB", 81920, False), GPU(1, "NVIDIA A100-SXM4-80GB", 81920, True)]
    assert gpus[0].memory_gib == 80.0
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        parse_nvidia_smi("garbage")


def test_detect_gpus_runs_the_configured_binary(fake_nvidia_smi):
    smi = fake_nvidia_smi(NVIDIA_SMI_LINES["h100-80gb"], NVIDIA_SMI_LINES["h200-141gb"].replace("0,", "1,", 1))
    assert [g.name for g in detect_gpus({"QWEN_VLLM_EXT_NVIDIA_SMI": smi})] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    # CUDA_VISIBLE_DEVICES narrows what vLLM will see
    assert [g.index for g in detect_gpus({"QWEN_VLLM_EXT_NVIDIA_SMI": smi, "CUDA_VISIBLE_DEVICES": "1"})] == [1]


def test_detect_gpus_without_driver(fake_nvidia_smi, tmp_path):
    assert detect_gpus({"QWEN_VLLM_EXT_NVIDIA_SMI": fake_nvidia_smi(exit_code=9)}) == []  # driver error
    assert detect_gpus({"QWEN_VLLM_EXT_NVIDIA_SMI": str(tmp_path / "missing")}) == []


@pytest.mark.parametrize("kind,expected", [("a100-80gb", "a100-80gb"), ("h100-80gb", "h100-80gb"), ("h200-141gb", "h200-141gb")])
def test_auto_selection_by_gpu_name_and_memory(kind, expected):
    profile = select_profile(gpus_for(kind))
    assert profile.name == expected
    check_hardware(profile, gpus_for(kind))  # does not raise


def test_no_gpu_selects_cpu_profile():
    assert select_profile([]).name == "cpu"
    check_hardware(load_profile("cpu"), [])


def test_mig_is_refused():
    gpus = gpus_for("a100-mig")
    with pytest.raises(ProfileError, match="MIG enabled.*40%"):
        check_hardware(select_profile(gpus), gpus)


def test_small_gpu_memory_is_refused():
    gpus = gpus_for("a100-40gb")
    profile = select_profile(gpus)
    assert profile.name == "a100-80gb"
    with pytest.raises(ProfileError, match=r"40.0 GiB; profile 'a100-80gb' needs 79 GiB"):
        check_hardware(profile, gpus)
    with pytest.raises(ProfileError, match="needs 139 GiB"):
        check_hardware(load_profile("h200-141gb"), gpus_for("h100-80gb"))


def test_unknown_gpu_and_unknown_profile_list_the_known_ones():
    with pytest.raises(ProfileError, match="no profile is made for GPU 'NVIDIA L4'.*a100-80gb, cpu, h100-80gb, h200-141gb"):
        select_profile(gpus_for("l4"))
    with pytest.raises(ProfileError, match="unknown profile 'a100'; known profiles: a100-80gb, cpu, h100-80gb, h200-141gb"):
        select_profile([], "a100")


def test_gpu_profile_without_gpu_is_refused():
    with pytest.raises(ProfileError, match="needs an NVIDIA GPU"):
        check_hardware(load_profile("a100-80gb"), [])


def test_profiles_are_complete_data_files():
    assert profile_names() == ["a100-80gb", "cpu", "h100-80gb", "h200-141gb"]
    a100 = load_profile("a100-80gb")
    assert a100.vllm == {
        "max-model-len": 32768, "max-num-seqs": 256, "max-num-batched-tokens": 8192, "block-size": 16,
        "enable-chunked-prefill": True, "enable-prefix-caching": True,
        "tensor-parallel-size": 1, "pipeline-parallel-size": 1,
        "kv-offloading-size": 64, "kv-offloading-backend": "native",  # KV-cache reuse: offload to host RAM
    }
    # flags from the report that are invalid or harmful today are NOT passed
    for name in profile_names():
        flags = load_profile(name).vllm
        assert "kv-cache-dtype" not in flags and "disable-log-requests" not in flags
        if load_profile(name).device == "cuda":
            assert "enforce-eager" not in flags
            assert load_profile(name).description and load_profile(name).min_gpu_memory_gib > 0


SIMULATED = ("a100-80gb", "h100-80gb", "h200-141gb")
"""GPU profiles whose hardware has a step-cost model in benchmarks/cost_models.json (docs/results/scheduler-sim/)."""
PROFILE_COST_MODELS = {"a100-80gb": ("a100-80gb",), "h100-80gb": ("h100-80gb",), "h200-141gb": ("h200-141gb",),
                       "cpu": ("cpu-demo", "cpu-prefill-bench")}
"""The step-cost models each profile's hardware is simulated with (the cpu profile: both CPU benchmark models)."""
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
SIM_LOADS = {"0.5", "0.8", "1.0", "1.2", "1.5", "1.7", "2.0"}
SIM_SEEDS = 4


REAL_EVIDENCE = RESULTS / "scheduler-real"
"""Where a real-engine comparison for a profile's hardware would be committed: ``<profile>.json``, the scheduler phase
of ``benchmarks/gpu_check.py`` (``aa_pass``, ``never_worse``, ``never_worse_auto``)."""
REAL_AUTO = {"prefill-bench-auto-1.7x": 0.90, "demo-auto-1.7x": None}
"""Issue #50's real-engine cells of ``auto`` on this machine (bench_scheduler.py, twelve paired observations at 1.7x)
and the upper edge its mean-TTFT interval must stay under where prefill dominates (None: only agreement)."""


def _json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def simulator_backs_auto(cost_model: str) -> bool:
    """The committed simulator pass on that cost model finds ``auto`` within issue #50's targets at every load and
    trace (medians over the seeds)."""
    cells = _json(RESULTS / "scheduler-sim" / f"auto-{cost_model}.json")["intervals"]["auto"]
    return set(cells) == {f"1-{x}" for x in SIM_LOADS} and all(c["targets_met"] for c in cells.values())


def real_engine_agrees(cell: str, mean_hi: float | None) -> bool:
    """A real-engine ``auto`` cell agrees with the simulator: its longest-decile p99 interval stays under 1.10 and its
    throughput interval over 0.97 (issue #50's real targets), the mean interval under ``mean_hi`` where given, and
    the simulator's predicted mean ratio lies inside the real interval."""
    result = _json(REAL_EVIDENCE / f"{cell}.json")
    (load,) = result["cells"]
    m = result["cells"][load]["all"]["metrics"]
    predicted = result["prediction"]["cells"][load]["ttft_mean_s"]
    return (m["long_decile_p99_ttft_s"]["hi"] <= 1.10 and m["output_tok_s"]["lo"] >= 0.97
            and (mean_hi is None or m["ttft_mean_s"]["hi"] <= mean_hi)
            and m["ttft_mean_s"]["lo"] <= predicted <= m["ttft_mean_s"]["hi"])


@pytest.mark.parametrize("name", profile_names())
def test_the_token_weighted_scheduler_mode_of_each_profile_follows_the_evidence(name):
    """Each profile's ``token_weighted_scheduler`` is what the committed evidence backs, and says so explicitly:

    * ``true`` (the policy always on), issue #35's rule: only where "never worse than FCFS" was shown on a real
      engine of its hardware — a committed comparison whose A/A pair and A/B cells pass;
    * ``auto`` (vLLM's own decisions below the overload gate, the policy above it), issue #50's rule: where the
      simulator finds it within the targets on that hardware's cost models at every load 0.5-2.0x and trace, and the
      real-engine cells this machine can run agree (or a real comparison on its hardware says never worse);
    * ``false`` otherwise."""
    from qwen_vllm_ext.config import Settings

    extension = load_profile(name).extension
    assert "token_weighted_scheduler" in extension
    evidence = REAL_EVIDENCE / f"{name}.json"
    phase = _json(evidence) if evidence.is_file() else {}
    backed_true = bool(phase.get("aa_pass") and phase.get("never_worse"))
    if phase.get("aa_pass") and phase.get("never_worse_auto") is not None:
        backed_auto = bool(phase["never_worse_auto"])  # a real engine of this hardware decides
    else:
        backed_auto = (all(simulator_backs_auto(cm) for cm in PROFILE_COST_MODELS[name])
                       and all(real_engine_agrees(cell, hi) for cell, hi in REAL_AUTO.items()))
    mode = Settings.resolve(env={}, base=extension).token_weighted_scheduler
    assert mode == ("true" if backed_true else "auto" if backed_auto else "false")


@pytest.mark.parametrize("name", SIMULATED)
def test_the_gpu_profiles_simulated_results_back_the_docs(name):
    """What the GPU profiles' comments and docs/scheduling.md claim: the committed simulator results for that
    hardware were run with the shipped defaults, always on (``shipped``) and behind the gate (``auto``), at every load
    0.5-2.0x and four seeds; always on meets every never-worse limit of issue #21 at every load (the reason to try it
    there; tests/integration/test_scheduler_profiles_sim.py re-runs seed 0)."""
    from qwen_vllm_ext.config import Settings

    assert name in profile_names()
    results = _json(RESULTS / "scheduler-sim" / f"auto-{name}.json")
    shipped = results["medians"]["shipped"]
    policy = dataclasses.asdict(Settings().scheduler)
    assert results["configs"]["shipped"] == {**policy, "mode": "true"}
    assert results["configs"]["auto"] == {**policy, "mode": "auto"}
    assert set(shipped) == {f"1-{x}" for x in SIM_LOADS} == set(results["medians"]["auto"])
    assert all(row["never_worse"] and row["seeds"] == SIM_SEEDS for row in shipped.values()), shipped
