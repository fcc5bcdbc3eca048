"""Running a benchmark script several times as `python SCRIPT ARGS...` would, in one Python process: what the script
imports (vLLM's scheduler: 8 s of CPU here) loads once, and each run executes the script afresh (new module state,
its own argv, stdout, stderr and exit status)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_RUNNER = r"""
import contextlib, json, runpy, sys, traceback
script, runs = sys.argv[1], json.loads(sys.argv[2])
for argv, out, err in runs:
    code = 0
    with open(out, "w") as o, open(err, "w") as e, contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        sys.argv = [script, *argv]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    print("EXIT " + json.dumps(code), flush=True)
"""


def run_script_runs(script: Path, argvs: list[list[str]], work: Path, cwd: Path | None = None,
                    timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """One :class:`subprocess.CompletedProcess` per argv, in order (``work``: a directory for their outputs)."""
    runs = [[list(argv), str(work / f"run{k}.out"), str(work / f"run{k}.err")] for k, argv in enumerate(argvs)]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(script), json.dumps(runs)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)
    codes = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("EXIT ")]
    assert proc.returncode == 0 and len(codes) == len(runs), proc.stdout[-2000:] + proc.stderr[-3000:]
    return [subprocess.CompletedProcess([script, *argv], code, Path(out).read_text(), Path(err).read_text())
            for (argv, out, err), code in zip(runs, codes)]
