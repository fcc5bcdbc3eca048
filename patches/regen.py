#!/usr/bin/env python3
"""Regenerate ``patches/vllm-<version>/*.patch`` from the edit recipes below (maintainers' tool).

    python patches/regen.py 0.32.0=.venv/lib/python3.11/site-packages/vllm 0.33.0=/tmp/vllm033/src/vllm

Each argument is a vLLM version and the directory of its ``vllm`` package (an installed one, or the sources
unzipped from the wheel: ``pip download --no-deps vllm==0.33.0 -d /tmp/vllm033 && cd /tmp/vllm033 &&
unzip -q vllm-*.whl 'vllm/*.py' -d src``). For each version it copies the files the recipes touch into a
temporary git repository, commits them, applies the recipes one commit per patch and writes
``git format-patch`` output with fixed author and dates, so the same sources give byte-identical patches.
Only diffs are written: vLLM's code is never committed here. ``QWEN_REGEN_OUT=DIR`` writes under DIR instead.

Every edit replaces an anchor that must occur exactly once in the file (or appends at the end of it), so a
vLLM version whose code moved fails loudly here instead of producing a wrong patch. Each change is one marked
call into ``qwen_vllm_ext.patches.hooks`` (``qwen-vllm-ext source patch: <name>``), which runs the same glue
code as the plugin path.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
APPEND = None  # an edit whose anchor is APPEND adds its text at the end of the file


def _module_hook(name: str, what: str) -> str:
    return f'''

# qwen-vllm-ext source patch: {name}
# {what}
# Same code as the plugin path (qwen_vllm_ext/patches/hooks.py); off with QWEN_VLLM_EXT_ENABLED=false.
from qwen_vllm_ext.patches.hooks import install as _qwen_vllm_ext_install  # noqa: E402

_qwen_vllm_ext_install("{name}")
'''


PATCHES = [
    {
        "name": "per-chunk-usage",
        "subject": "qwen-vllm-ext: usage with cached tokens and billing on every streamed chunk",
        "body": "Chat and completion streams carry cumulative usage on every chunk, with\n"
                "prompt_tokens_details.cached_tokens and usage.billing, and always end with the\n"
                "choices=[] usage chunk (settings per_chunk_usage, billing_policy).\n",
        "edits": [("vllm/entrypoints/openai/chat_completion/serving.py", APPEND, _module_hook(
            "per_chunk_usage", "every streamed chat/completion chunk carries usage, cached tokens and billing."))],
    },
    {
        "name": "usage-accounting",
        "subject": "qwen-vllm-ext: report each engine request's final counts to the usage ledger",
        "body": "OutputProcessor.add_request / _update_stats_from_finished / abort_requests report\n"
                "the counts vLLM's own statistics use to the ledger (setting ledger).\n",
        "edits": [("vllm/v1/engine/output_processor.py", APPEND, _module_hook(
            "usage_accounting", "the usage ledger gets each engine request's final counts (setting ledger)."))],
    },
    {
        "name": "token-weighted-scheduler",
        "subject": "qwen-vllm-ext: token-weighted, cache-aware scheduler when --scheduler-cls is unset",
        "body": "With token_weighted_scheduler=true (QWEN_VLLM_EXT_TOKEN_WEIGHTED_SCHEDULER=1) the engine\n"
                "core uses qwen_vllm_ext.scheduling.vllm_scheduler.TokenWeighted(Async)Scheduler;\n"
                "an explicit --scheduler-cls still wins.\n",
        "edits": [("vllm/config/scheduler.py",
                   '''    def get_scheduler_cls(self) -> type["SchedulerInterface"]:
        if self.scheduler_cls is None:
''',
                   '''    def get_scheduler_cls(self) -> type["SchedulerInterface"]:
        if self.scheduler_cls is None:
            # qwen-vllm-ext source patch: token_weighted_scheduler
            from qwen_vllm_ext.patches.hooks import scheduler_cls as _qwen_scheduler_cls

            qwen_cls = _qwen_scheduler_cls(self)
            if qwen_cls is not None:
                return qwen_cls
''')],
    },
    {
        "name": "api-server-hooks",
        "subject": "qwen-vllm-ext: ledger and gateway middlewares, health and token-count routes",
        "body": "build_app adds what the endpoint plugin adds (GET /qwen_ext/health, POST /v1/tokens/count,\n"
                "the gateway and usage-ledger middlewares); init_app_state sets their state; the API\n"
                "server fixes the instance directory before spawning the engine. Skipped when the\n"
                "endpoint plugin is loaded too.\n",
        "edits": [
            ("vllm/entrypoints/launchers/app.py",
             '''    attach_endpoint_plugins(app, supported_tasks)
''',
             '''    attach_endpoint_plugins(app, supported_tasks)
    # qwen-vllm-ext source patch: api_server
    from qwen_vllm_ext.patches.hooks import attach_app as _qwen_attach_app

    _qwen_attach_app(app)
'''),
            ("vllm/entrypoints/launchers/api_server/app_state.py",
             '''    await init_endpoint_plugins_state(engine_client, state, args)
''',
             '''    await init_endpoint_plugins_state(engine_client, state, args)
    # qwen-vllm-ext source patch: api_server
    from qwen_vllm_ext.patches.hooks import init_state as _qwen_init_state

    await _qwen_init_state(engine_client, state, args)
'''),
            ("vllm/entrypoints/launchers/api_server/entry.py",
             '''    """Run a single API server worker."""
''',
             '''    """Run a single API server worker."""
    # qwen-vllm-ext source patch: api_server
    from qwen_vllm_ext.patches.hooks import server_starting as _qwen_server_starting

    _qwen_server_starting()
'''),
            ("vllm/entrypoints/cli/serve.py",
             '''def run_multi_api_server(args: argparse.Namespace):
    assert not args.headless
''',
             '''def run_multi_api_server(args: argparse.Namespace):
    assert not args.headless
    # qwen-vllm-ext source patch: api_server
    from qwen_vllm_ext.patches.hooks import server_starting as _qwen_server_starting

    _qwen_server_starting()
'''),
        ],
    },
    {
        "name": "kv-reuse-template",
        "subject": "qwen-vllm-ext: prefix-stable Qwen3 chat template by default (KV-cache reuse)",
        "body": "When no --chat-template is given and the model is a Qwen3 hybrid-thinking model, serve\n"
                "the package's qwen3-reuse template with preserve_thinking=true as the default\n"
                "chat_template_kwargs, as the launcher does (setting kv_reuse_template).\n",
        "edits": [("vllm/entrypoints/launchers/api_server/app_state.py",
                   '''    resolved_chat_template = load_chat_template(args.chat_template)
''',
                   '''    # qwen-vllm-ext source patch: kv_reuse_template
    from qwen_vllm_ext.patches.hooks import chat_defaults as _qwen_chat_defaults

    _qwen_chat_defaults(args)
    resolved_chat_template = load_chat_template(args.chat_template)
''')],
    },
    {
        "name": "turn-checkpoints",
        "subject": "qwen-vllm-ext: hybrid models keep the state where the next chat turn diverges",
        "body": "On align-mode hybrid models (Gated DeltaNet + attention) each chat request's junction\n"
                "checkpoint is set just after its last <|im_start|>assistant opener, where the next\n"
                "turn's prompt diverges, so the next turn resumes there (setting kv_turn_checkpoints).\n"
                "With the prefix-stable qwen3.5-reuse template the decode state is kept every 16\n"
                "generated tokens too, the newest per request, so the next turn also reuses the answer\n"
                "(setting kv_answer_checkpoints).\n",
        "edits": [("vllm/v1/core/sched/scheduler.py", APPEND, _module_hook(
            "turn_checkpoints", "hybrid models keep the state where the next chat turn diverges "
            "(setting kv_turn_checkpoints)."))],
    },
    {
        "name": "connection-guard",
        "subject": "qwen-vllm-ext: header timeout and connection cap on the API server's sockets",
        "body": "NoSignalServer serves uvicorn's HTTP protocol with a header timeout (408 for a connection\n"
                "that sends no complete request head in time) and a connection cap below the open-file\n"
                "limit (the oldest idle connection makes room, else 503); the open-file limit is raised\n"
                "to the hard limit (settings connection_guard, header_timeout_s, max_connections).\n",
        "edits": [("vllm/entrypoints/launchers/launcher.py", APPEND, _module_hook(
            "connection_guard", "idle connections time out and the open connections stay below the open-file "
            "limit (setting connection_guard)."))],
    },
    {
        "name": "cpu-seeded-sampling",
        "subject": "qwen-vllm-ext: a seeded request prefilled in chunks does not kill the CPU engine",
        "body": "CPUModelRunner saves the generator state of the rows whose sampled token is discarded (a\n"
                "prefill split across steps) and restores it after sampling, instead of the offset rewind a\n"
                "CPU torch.Generator does not support (RuntimeError, EngineDeadError; setting\n"
                "cpu_seeded_sampling).\n",
        "edits": [("vllm/v1/worker/cpu_model_runner.py", APPEND, _module_hook(
            "cpu_seeded_sampling", "a seeded request prefilled in chunks keeps its sampling stream on the CPU "
            "(setting cpu_seeded_sampling)."))],
    },
    {
        "name": "cpu-spec-decode-kernels",
        "subject": "qwen-vllm-ext: speculative decoding on a hybrid model with prefix caching on the CPU build",
        "body": "The fused Triton kernels that move recurrent states under speculative decoding in align\n"
                "mode (precopy_mamba_align_fused_kernel, postprocess_mamba_fused_kernel) get CPU\n"
                "implementations through vLLM's kernel-override registry when Triton is absent (setting\n"
                "cpu_spec_decode_kernels).\n",
        "edits": [("vllm/v1/worker/mamba_utils.py", APPEND, _module_hook(
            "cpu_spec_decode_kernels", "CPU implementations of the fused recurrent-state copies of speculative "
            "decoding (setting cpu_spec_decode_kernels)."))],
    },
    {
        "name": "kv-copies",
        "subject": "qwen-vllm-ext: KV-cache block copies of layers sharing a tensor, and answer-state copies under MTP",
        "body": "The model runner's block copy (copy-on-write of a partial-block prefix hit) copies every byte\n"
                "any layer view uses in a block: with MTP a hybrid model packs an attention layer and a Gated\n"
                "DeltaNet layer at one tensor address, and vLLM copied only the first view there (setting\n"
                "kv_block_copies). GPUModelRunner._update_states first runs the recurrent-state copies the\n"
                "scheduler attaches under speculative decoding: the answer checkpoint inside a verify step\n"
                "(settings kv_turn_checkpoints, kv_answer_checkpoints).\n",
        "edits": [("vllm/v1/worker/gpu_model_runner.py", APPEND, _module_hook(
            "kv_copies", "KV-cache block copies of layers sharing a tensor, and answer checkpoints inside a "
            "speculative-decoding step (settings kv_block_copies, kv_answer_checkpoints)."))],
    },
]

GIT_ENV = {
    "GIT_AUTHOR_NAME": "qwen-vllm-ext", "GIT_AUTHOR_EMAIL": "qwen-vllm-ext@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "qwen-vllm-ext", "GIT_COMMITTER_EMAIL": "qwen-vllm-ext@users.noreply.github.com",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", "-c", "core.autocrlf=false", *args], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def regenerate(version: str, vllm_dir: Path, out_base: Path = HERE) -> list[Path]:
    vllm_dir = vllm_dir.resolve()
    files = sorted({rel for p in PATCHES for rel, _, _ in p["edits"]})
    out = out_base / f"vllm-{version}"
    written = []
    with tempfile.TemporaryDirectory(prefix="qwen-patches-") as tmp:
        repo = Path(tmp)
        for rel in files:
            dest = repo / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(vllm_dir.parent / rel, dest)
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"vLLM {version} (pristine files)")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for number, patch in enumerate(PATCHES, 1):
            for rel, anchor, text in patch["edits"]:
                path = repo / rel
                source = path.read_text(encoding="utf-8")
                if anchor is APPEND:
                    source = source + text
                else:
                    count = source.count(anchor)
                    if count != 1:
                        raise SystemExit(f"vLLM {version}: anchor of {patch['name']} found {count} times in {rel}")
                    source = source.replace(anchor, text)
                path.write_text(source, encoding="utf-8")
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{patch['subject']}\n\n{patch['body']}")
            text = _git(repo, "format-patch", "-1", "--stdout", "--zero-commit", "--no-signature",
                        "--subject-prefix=PATCH", "-N", "HEAD")
            target = out / f"{number:04d}-{patch['name']}.patch"
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print(__doc__, file=sys.stderr)
        return 2
    out_base = Path(os.environ.get("QWEN_REGEN_OUT", HERE))  # tests write elsewhere
    for arg in argv:
        version, directory = arg.split("=", 1)
        for path in regenerate(version, Path(directory), out_base):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
