"""benchmarks.ab_calculator: what it compiles (a revision's package files) and how it reads the rounds."""
import subprocess

import pytest

from benchmarks import ab_calculator as ab


def test_summary_best_against_best_and_paired_median():
    # side B twice as fast on "x" cold in every round; warm equal; "y" B slower in the best round only
    a = [{"x": [2.0, 1.0, 5], "y": [1.0, 1.0, 3]}, {"x": [4.0, 1.0, 5], "y": [3.0, 1.0, 3]},
         {"x": [6.0, 1.0, 5], "y": [1.0, 1.0, 3]}]
    b = [{"x": [1.0, 1.0, 5], "y": [2.0, 1.0, 3]}, {"x": [2.0, 1.0, 5], "y": [1.0, 1.0, 3]},
         {"x": [3.0, 1.0, 5], "y": [1.0, 1.0, 3]}]
    rows = {r["slice"]: r for r in ab.summarize(a, b, {"x": 2_000_000, "y": 1_000_000})}
    assert rows["x"]["cold_best"] == 2.0 and rows["x"]["cold_paired"] == 2.0
    assert rows["x"]["a_cold"] == pytest.approx(1.0) and rows["x"]["b_cold"] == pytest.approx(2.0)
    assert rows["x"]["warm_best"] == 1.0 and rows["x"]["warm_paired"] == 1.0
    assert rows["y"]["cold_best"] == 1.0 and rows["y"]["cold_paired"] == 1.0   # ratios 0.5, 3, 1 -> median 1
    text = ab.table(list(rows.values()), "A1", "B1")
    assert "A = A1, B = B1" in text and "2.000 (2.000)" in text


def test_a_revision_is_its_package_files():
    head = ab._files("HEAD")
    assert "_core.pyx" in head and "tokenizer.py" in head and all(n.endswith((".py", ".pyx")) for n in head)
    tracked = subprocess.run(["git", "-C", ab.ROOT, "show", f"HEAD:{ab.PACKAGE}/_core.pyx"], capture_output=True,
                             check=True).stdout
    assert head["_core.pyx"] == tracked
    assert set(ab._files("worktree")) >= set(head)


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(["--rounds", "0"])
    assert exc.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--vocab", "gpt2"])
