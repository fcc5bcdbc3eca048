"""Generated model variants (qwen_vllm_ext.demo.VARIANTS): valid overrides, unknown names refused."""
import pytest

from qwen_vllm_ext import demo


def test_unknown_variant_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as exc:
        demo.ensure_demo_model(tmp_path, variant="huge")
    assert "huge" in str(exc.value)
    for name in demo.VARIANTS:
        assert name in str(exc.value)
    assert not any(tmp_path.iterdir())  # nothing built


@pytest.mark.parametrize("variant", sorted(demo.VARIANTS))
def test_variant_overrides_only_known_config_fields(variant):
    overrides = demo.VARIANTS[variant]
    assert set(overrides) <= set(demo.CONFIG), set(overrides) - set(demo.CONFIG)
    config = {**demo.CONFIG, **overrides}
    assert config["head_dim"] >= 32  # vLLM's CPU attention
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    # Special tokens and the ids the scheduler benchmark draws (1000 .. vocab-100) exist in the embedding.
    if config["vocab_size"] < demo.CONFIG["vocab_size"]:
        assert config["vocab_size"] - 100 > 1000
    else:
        assert config["eos_token_id"] < config["vocab_size"]


def test_demo_variant_is_the_demo_model_unchanged():
    assert demo.VARIANTS["demo"] == {}
