"""The documentation: the generated settings reference is current, local links resolve, the README stays short."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# The first lines of the README: CI and users depend on these two commands.
README_HEAD = """\
# qwen-vllm-ext

```bash
./scripts/serve.sh     # set up (first run: ~5 min) and start the server; no GPU/--model → the built-in demo model
./scripts/test.sh      # set up and run the whole test suite, end-to-end tests against real vLLM included
```
"""


def _generator():
    spec = importlib.util.spec_from_file_location("gen_settings_doc", ROOT / "scripts" / "gen_settings_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markdown_files():
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _local_links(text: str):
    """Targets of ``[text](target)`` links outside code, without web addresses and in-page anchors."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        yield target.split("#", 1)[0]


def test_settings_reference_is_generated_from_the_settings_class():
    gen = _generator()
    expected = gen.render()
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == expected, (
        "docs/settings.md is not current: run .venv/bin/python scripts/gen_settings_doc.py")
    from qwen_vllm_ext.config import Settings

    rows = [line for line in expected.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([^`]+)` \| `[^`]*` \| .+ \|$", row).group(1) for row in rows] == Settings.field_names()


def test_settings_reference_check_mode(tmp_path):
    gen = _generator()
    out = tmp_path / "settings.md"
    assert gen.main(["--check", "--output", str(out)]) == 1  # missing
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text() + "stale\n")
    assert gen.main(["--check", "--output", str(out)]) == 1


def test_a_field_added_later_shows_up():
    import dataclasses

    gen = _generator()

    @dataclasses.dataclass(frozen=True)
    class Extended:
        alpha: int = 3
        """First ``knob``."""
        beta: str = dataclasses.field(default_factory=lambda: "x")
        """Second
        knob | piped."""

    assert gen.rows(Extended) == ["| `alpha` | `3` | First `knob`. |", "| `beta` | `x` | Second knob \\| piped. |"]


def test_every_relative_link_resolves():
    broken = []
    for path in _markdown_files():
        for target in _local_links(path.read_text(encoding="utf-8")):
            if target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_short_page_that_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 220
    assert text.startswith(README_HEAD)
