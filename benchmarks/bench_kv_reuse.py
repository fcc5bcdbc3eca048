"""KV-cache reuse across chat turns: M conversations x 10 turns against the demo server, three server modes in one run.

    .venv/bin/python -m benchmarks.bench_kv_reuse [--conversations 2] [--turns 10] [--block-size 32]
    .venv/bin/python -m benchmarks.bench_kv_reuse --model qwen36-demo [--conversations 4]   # the hybrid demo
    .venv/bin/python -m benchmarks.bench_kv_reuse --model qwen36-demo --answers generated   # answer reuse

With ``--model qwen36-demo`` (see ``run_hybrid``): the hybrid demo under the official Qwen3.5 template, canned
answers of 20-600 tokens, thinking on and off, one server per mode of :data:`HYBRID_MODES` (the product's turn
checkpoints against vLLM's own configurations and no cache); per request the prompt ids' longest prefix shared with
the previous request (``shared``) and the best a cache can give (``bound``: shared floored to the 16-token match
unit); writes benchmarks/results/bench_kv_reuse-hybrid.json and .png. With ``--answers generated`` the model writes
answers of 20-600 tokens (:func:`generated_conversation`) and they are fed back as generated, one server per mode of
:data:`HYBRID_GENERATED_MODES` (the product's prefix-stable template with turn and answer checkpoints against the
template alone, vLLM's best configurations with the official template, and no cache); writes
benchmarks/results/bench_kv_reuse-hybrid-generated.json and .png.

Server modes (one server at a time, all with ``--block-size B`` and the same demo model):

* ``reuse``    — the launcher's default: the prefix-stable ``qwen3-reuse`` template, prefix caching on;
* ``stock``    — ``--qwen-kv-reuse-template false``: the model's official Qwen3 template, prefix caching on;
* ``no-cache`` — the official template with ``--no-enable-prefix-caching``: the no-reuse baseline.

Each conversation is run with thinking on and off and in three ways of feeding the assistant turns back:

* ``canonical`` — the model samples only single-token words (``allowed_token_ids``) and its answer is fed back as
  generated: re-tokenizing the text gives the very ids it generated, as with a real model's ordinary text;
* ``generated`` — free sampling fed back as generated: a random-weight model emits ids that re-tokenize
  differently (non-canonical BPE), which breaks reuse inside the completion whatever the template does;
* ``canned``    — a fixed answer text is fed back instead of what was generated: the previous prompt is reusable,
  the previous completion never is.

Thinking on: the reasoning is scripted — the turn's request ends with an assistant prefill
``<think>\\n{reasoning}\\n</think>\\n\\n`` (``continue_final_message``), as if the model had written it; the history
turn is fed back with that reasoning (``reasoning_content``) and the generated answer.

Per turn: prompt tokens, cached tokens (usage of the streamed chunks), computed prefill tokens (prompt − cached),
TTFT, and the reuse ratio cached ÷ (previous turn's prompt + completion). Targets, on the canonical runs:
computed prefill tokens ≥ 68% fewer than ``no-cache``; in ``reuse`` mode every turn after the first gets ≥ 90% of the
previous turn's prompt + completion from cache. Writes benchmarks/results/bench_kv_reuse.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx

from qwen_vllm_ext.bench.analysis import percentile
from qwen_vllm_ext.bench.server import ServeProcess
from qwen_vllm_ext.kv.reuse import common_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MODEL = "qwen3-demo"
IM_END = 151645
SYSTEM = ("You are a careful assistant for a travel company. Answer in plain words, keep answers short, and ask "
          "before booking anything. The customer's profile: prefers trains over planes, travels with a dog, likes "
          "quiet hotels near parks, budget is moderate, speaks English and a little German. ") * 3
QUESTIONS = ["Where should I go in spring?", "Is the train from Berlin to Vienna comfortable?",
             "Can my dog come on the night train?", "Which hotels near a park do you suggest?",
             "How much does that cost per night?", "What about the weather in April?",
             "Are there quiet cafes nearby?", "Can I get there from the station on foot?",
             "What should I pack?", "Please summarize the plan."]
REASONINGS = ["The customer wants a spring trip; trains preferred.", "Check the route and comfort of the train.",
              "Dog policy on night trains matters here.", "Look for quiet hotels close to parks.",
              "Estimate a moderate price range.", "Spring weather is mild but can be rainy.",
              "Suggest calm places close to the hotel.", "Consider the walking distance.",
              "Packing list for mild rainy weather and a dog.", "Collect the decisions so far."]
CANNED = ["Vienna is lovely in spring.", "Yes, the day train is comfortable and quiet.",
          "Small dogs travel free in most compartments.", "Two quiet hotels face the city park.",
          "About ninety euros per night.", "Mild, with some rain showers.", "Yes, several calm cafes.",
          "About fifteen minutes on foot.", "A rain jacket and the dog's papers.", "Train, park hotel, five nights."]
WORDS = [" the", " cat", " dog", " sat", " on", " mat", " red", " blue", " big", " small", " house", " tree",
         " runs", " fast", " and", " a", " train", " park", " quiet", " hotel", " rain", " walk", " city", " night"]


def word_token_ids() -> list[int]:
    """Ids of single-token words (each re-tokenizes to itself in any sequence: ' word' is its own pre-token)."""
    from qwen_v3_calculator.tokenizer import Tokenizer

    tok = Tokenizer.bundled("qwen3")
    ids = []
    for w in WORDS:
        enc = tok.encode(w)
        assert len(enc) == 1, (w, enc)
        ids.append(enc[0])
    return ids


def chat_turn(client: httpx.Client, body: dict, headers: dict) -> dict:
    """One streamed chat request: prompt ids, generated ids, text and reasoning (vLLM's reasoning parser's split),
    last chunk's usage, TTFT."""
    started = time.perf_counter()
    prompt_ids, gen_ids, text, usage, ttft, finish, chunks_with_usage = None, [], [], None, None, None, 0
    reasoning = []
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("prompt_token_ids") is not None:
                prompt_ids = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                usage = chunk["usage"]
                chunks_with_usage += 1
            for choice in chunk.get("choices") or ():
                if choice.get("token_ids"):
                    gen_ids += choice["token_ids"]
                    if ttft is None:
                        ttft = time.perf_counter() - started
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                if delta.get("reasoning") or delta.get("reasoning_content"):
                    reasoning.append(delta.get("reasoning") or delta.get("reasoning_content"))
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_ids": prompt_ids, "gen_ids": gen_ids, "text": "".join(text), "reasoning": "".join(reasoning),
            "finish": finish,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": details.get("cached_tokens") or 0, "ttft_s": ttft, "chunks_with_usage": chunks_with_usage,
            "elapsed_s": time.perf_counter() - started}


def run_conversation(base_url: str, conv_id: str, *, thinking: bool, feedback: str, preserve: bool | None = None,
                     turns: int = 10, max_tokens: int = 32, seed: int = 0, word_ids: list[int] | None = None,
                     timeout: float = 120.0, headers: dict | None = None) -> list[dict]:
    """Drive one scripted conversation; returns one dict per turn (see :func:`chat_turn`) plus ``prev_tokens``
    (previous turn's prompt + completion), ``lcp`` (common token prefix of the previous turn's prompt + generated
    ids with this prompt) and ``prev_prompt_tokens``. ``preserve``: send ``preserve_thinking`` (None: leave the
    server default). The conversation id goes in ``x-session-id`` (what vllm-router hashes and the reuse tracker
    reads); ``headers`` are added to every request (e.g. Authorization)."""
    messages = [{"role": "system", "content": SYSTEM}]
    out: list[dict] = []
    template_kwargs = {"enable_thinking": thinking}
    if preserve is not None:
        template_kwargs["preserve_thinking"] = preserve
    with httpx.Client(base_url=base_url, timeout=timeout) as client:
        for t in range(turns):
            question = QUESTIONS[t % len(QUESTIONS)]
            messages.append({"role": "user", "content": f"[{conv_id}] {question}" if t == 0 else question})
            body = {"model": MODEL, "messages": list(messages), "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                    "return_token_ids": True, "seed": seed * 1000 + t, "chat_template_kwargs": template_kwargs}
            reasoning = REASONINGS[t % len(REASONINGS)]
            if thinking:  # scripted reasoning, as if the model had written it
                body["messages"].append({"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n"})
                body.update(add_generation_prompt=False, continue_final_message=True)
            if feedback == "canonical":
                body["allowed_token_ids"] = [*(word_ids or word_token_ids()), IM_END]
            turn = chat_turn(client, body, {"x-session-id": conv_id, **(headers or {})})
            answer = CANNED[t % len(CANNED)] if feedback == "canned" else turn["text"]
            assistant = {"role": "assistant", "content": answer}
            if thinking:
                assistant["reasoning_content"] = reasoning
            messages.append(assistant)
            if out:
                prev = out[-1]
                turn["prev_tokens"] = prev["prompt_tokens"] + prev["completion_tokens"]
                turn["prev_prompt_tokens"] = prev["prompt_tokens"]
                turn["lcp"] = common_prefix(prev["prompt_ids"] + prev["gen_ids"], turn["prompt_ids"])
            out.append(turn)
    return out


# ------------------------------------------------------------------------------------------------ servers
def start_server(extra: list[str], data_dir: str, log_path: str) -> ServeProcess:
    return ServeProcess(["--qwen-data-dir", data_dir, *extra], log_path, cwd=ROOT)


SERVER_MODES = {
    "reuse": [],
    "stock": ["--qwen-kv-reuse-template", "false"],
    "no-cache": ["--qwen-kv-reuse-template", "false", "--no-enable-prefix-caching"],
}


# ------------------------------------------------------------------------------------------------ summary
def summarize(runs: list[list[dict]], turns: int, block_size: int) -> dict:
    """Per-turn sums over conversations and totals. ``full_blocks``: turns whose cached tokens cover the previous
    turn's prompt + completion down to the block boundary (all a prefix cache can give)."""
    per_turn = []
    for t in range(turns):
        rows = [r[t] for r in runs]
        prompt = sum(x["prompt_tokens"] for x in rows)
        cached = sum(x["cached_tokens"] for x in rows)
        prev = sum(x.get("prev_tokens", 0) for x in rows)
        ratios = [x["cached_tokens"] / x["prev_tokens"] for x in rows if x.get("prev_tokens")]
        per_turn.append({"turn": t + 1, "prompt_tokens": prompt, "cached_tokens": cached, "computed": prompt - cached,
                         "ttft_ms": 1000 * sum(x["ttft_s"] or 0 for x in rows) / len(rows),
                         "reuse_ratio_min": min(ratios) if ratios else None,
                         "reuse_ratio_mean": (sum(ratios) / len(ratios)) if ratios else None,
                         "prev_tokens": prev,
                         "full_blocks": sum(1 for x in rows if x.get("prev_tokens") and x["cached_tokens"]
                                            >= (x["prev_tokens"] - 1) // block_size * block_size)})
    total = {k: sum(p[k] for p in per_turn) for k in ("prompt_tokens", "cached_tokens", "computed")}
    total["ttft_ms_mean"] = sum(p["ttft_ms"] for p in per_turn) / len(per_turn)
    later = [p["reuse_ratio_min"] for p in per_turn[1:] if p["reuse_ratio_min"] is not None]
    total["reuse_ratio_min"] = min(later) if later else None
    means = [p["reuse_ratio_mean"] for p in per_turn[1:] if p["reuse_ratio_mean"] is not None]
    total["reuse_ratio_mean"] = sum(means) / len(means) if means else None
    total["full_blocks"] = sum(p["full_blocks"] for p in per_turn)
    total["turns_after_first"] = len(runs) * (turns - 1)
    return {"per_turn": per_turn, "total": total}


def _two_panels():
    """(pyplot, figure, two axes) for a thinking-on / thinking-off plot; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return (plt, *plt.subplots(1, 2, figsize=(13, 4.8)))


def plot(path: str, results: dict, block_size: int) -> bool:
    panels = _two_panels()
    if panels is None:
        return False
    plt, fig, axes = panels
    for thinking, ax in zip(("on", "off"), axes):
        for mode, style in (("no-cache", ":"), ("stock", "--"), ("reuse", "-")):
            for feedback, color in (("canonical", "tab:green"), ("generated", "tab:red"), ("canned", "tab:blue")):
                s = results[mode][f"thinking-{thinking}"][feedback]
                ax.plot([p["turn"] for p in s["per_turn"]], [p["computed"] for p in s["per_turn"]], style,
                        color=color, label=f"{mode} / {feedback}", marker="o", ms=3)
        ax.set_title(f"computed prefill tokens per turn, thinking {thinking} (block size {block_size})")
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt − cached tokens (sum over conversations)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=2, help="M conversations per (mode, thinking, feedback)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32,
                    help="vLLM --block-size: the CPU build needs a multiple of 32 (its default is 128; GPU profiles use 16)")
    ap.add_argument("--modes", default=None, help="server modes (default: reuse,stock,no-cache; with --model "
                    f"{HYBRID_MODEL}: {','.join(HYBRID_MODES)})")
    ap.add_argument("--model", default=MODEL, choices=[MODEL, HYBRID_MODEL],
                    help=f"{HYBRID_MODEL}: the hybrid demo (official Qwen3.5 template, canned answers, the "
                         "extension's turn checkpoints against vLLM's configurations)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_kv_reuse.json"))
    ap.add_argument("--kv-blocks", type=int, default=0, help=f"{HYBRID_MODEL}: --num-gpu-blocks-override (a KV "
                    "cache that holds a fraction of the conversations; 0: the profile's)")
    ap.add_argument("--interleave", action="store_true",
                    help=f"{HYBRID_MODEL}: turn t of every conversation before turn t+1 of any")
    ap.add_argument("--thinking-on-only", action="store_true", help=f"{HYBRID_MODEL}: skip the thinking-off runs")
    ap.add_argument("--thinking-off-only", action="store_true", help=f"{HYBRID_MODEL}: skip the thinking-on runs")
    ap.add_argument("--answers", choices=("canned", "generated"), default="canned",
                    help=f"{HYBRID_MODEL}: canned answers under the official template (turn checkpoints), or answers "
                         "the model generates, fed back as generated (answer checkpoints; modes: "
                         f"{','.join(HYBRID_GENERATED_MODES)})")
    ap.add_argument("--summarize", metavar="JSON", help=f"{HYBRID_MODEL}: recompute the table from a written JSON's "
                    "raw turns (no server)")
    ap.add_argument("--saturation", type=int, default=0, metavar="ROUNDS",
                    help=f"{HYBRID_MODEL}: answer checkpoints on vs off at a concurrency the cache limits, each "
                         "against itself, ROUNDS rounds (issue 48 item 3)")
    ap.add_argument("--concurrency", type=int, default=16, help="--saturation: concurrent conversations")
    args = ap.parse_args(argv)
    if args.saturation:
        if args.out == os.path.join(RESULTS, "bench_kv_reuse.json"):
            args.out = os.path.join(RESULTS, "bench_kv_reuse-hybrid-saturation.json")
        return run_saturation(args)
    if args.summarize:
        with open(args.summarize) as f:
            results = json.load(f)
        for data in results["modes"].values():
            for key in ("thinking-on", "thinking-off"):
                if key in data:
                    data[key]["total"] = summarize_hybrid(data[key]["raw"])
        raw = [r for data in results["modes"].values() for key in ("thinking-on", "thinking-off") if key in data
               for run in data[key]["raw"] for r in run]
        run_args = argparse.Namespace(**{**results["config"],
                                         "answers": "generated" if any("prev_seen" in r for r in raw) else "canned"})
        report_hybrid(results, run_args)
        return 0
    if args.model == HYBRID_MODEL:
        args.modes = args.modes or ",".join(HYBRID_GENERATED_MODES if args.answers == "generated" else HYBRID_MODES)
        return run_hybrid(args)
    args.modes = args.modes or "reuse,stock,no-cache"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    word_ids = word_token_ids()
    results: dict = {"config": {**vars(args), "word_tokens": len(word_ids)}, "started": time.time()}
    tmp = tempfile.mkdtemp(prefix="bench-kv-reuse-")
    t0 = time.monotonic()
    for mode in args.modes.split(","):
        server = start_server([*SERVER_MODES[mode], "--block-size", str(args.block_size)], os.path.join(tmp, mode),
                              os.path.join(tmp, f"{mode}.log"))
        try:
            server.wait_healthy()
            print(f"[{time.monotonic() - t0:6.1f}s] {mode}: server up", file=sys.stderr)
            results[mode] = {}
            for thinking in (True, False):
                key = f"thinking-{'on' if thinking else 'off'}"
                results[mode][key] = {}
                for feedback in ("canonical", "generated", "canned"):
                    runs = [run_conversation(server.base_url, f"{mode}-{key}-{feedback}-{m}", thinking=thinking,
                                             feedback=feedback, turns=args.turns, max_tokens=args.max_tokens, seed=m,
                                             word_ids=word_ids) for m in range(args.conversations)]
                    summary = summarize(runs, args.turns, args.block_size)
                    dropped = ("prompt_ids", "gen_ids", "text", "reasoning")
                    summary["raw"] = [[{k: v for k, v in turn.items() if k not in dropped} for turn in run]
                                      for run in runs]
                    results[mode][key][feedback] = summary
        finally:
            server.stop()
    results["elapsed_s"] = time.monotonic() - t0
    report(results, args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    drawn = plot(png, results, args.block_size) if all(m in results for m in SERVER_MODES) else False
    print(f"\nwrote {args.out}" + (f" and {png}" if drawn else ""), file=sys.stderr)
    return 0


def report(results: dict, args) -> None:
    modes = [m for m in SERVER_MODES if m in results]
    print(f"\nKV-cache reuse, {args.conversations} conversations x {args.turns} turns, block size {args.block_size}, "
          f"{results['elapsed_s']:.0f} s\n")
    print("| thinking | feedback | mode | prompt tokens | cached | computed prefill | vs no-cache | "
          "reuse ratio min / mean (turns 2+) | turns reused to the block boundary | mean TTFT ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in ("thinking-on", "thinking-off"):
        for feedback in ("canonical", "generated", "canned"):
            base = results.get("no-cache", {}).get(key, {}).get(feedback, {}).get("total", {}).get("computed")
            for mode in modes:
                t = results[mode][key][feedback]["total"]
                fewer = f"−{100 * (1 - t['computed'] / base):.1f}%" if base else "—"
                ratio = "—" if t["reuse_ratio_min"] is None else \
                    f"{t['reuse_ratio_min']:.3f} / {t['reuse_ratio_mean']:.3f}"
                print(f"| {key[9:]} | {feedback} | {mode} | {t['prompt_tokens']} | {t['cached_tokens']} | "
                      f"{t['computed']} | {fewer} | {ratio} | {t['full_blocks']}/{t['turns_after_first']} | "
                      f"{t['ttft_ms_mean']:.1f} |")
    if "reuse" in results:
        print("\nPer turn, reuse mode, canonical feedback (sums over conversations):\n")
        print("| thinking | turn | prompt | cached | computed | prev prompt+completion | min reuse ratio | TTFT ms |")
        print("|---|---|---|---|---|---|---|---|")
        for key in ("thinking-on", "thinking-off"):
            for p in results["reuse"][key]["canonical"]["per_turn"]:
                r = "—" if p["reuse_ratio_min"] is None else f"{p['reuse_ratio_min']:.3f}"
                print(f"| {key[9:]} | {p['turn']} | {p['prompt_tokens']} | {p['cached_tokens']} | {p['computed']} | "
                      f"{p['prev_tokens']} | {r} | {p['ttft_ms']:.1f} |")
    if "reuse" in results and "no-cache" in results:
        print("\nTargets (canonical feedback):")
        for key in ("thinking-on", "thinking-off"):
            r, b = results["reuse"][key]["canonical"]["total"], results["no-cache"][key]["canonical"]["total"]
            fewer = 1 - r["computed"] / b["computed"]
            print(f"  thinking {key[9:]}: computed prefill {100 * fewer:.1f}% fewer than no-cache "
                  f"({'met' if fewer >= 0.68 else 'NOT met'}, target 68%); min reuse ratio {r['reuse_ratio_min']:.3f} "
                  f"({'met' if r['reuse_ratio_min'] >= 0.9 else 'NOT met'}, target 0.90)")


# ------------------------------------------------------------------------------------------------ hybrid model
HYBRID_MODEL = "qwen36-demo"
HYBRID_OFF = {"QWEN_VLLM_EXT_KV_TURN_CHECKPOINTS": "false"}  # vLLM's own checkpoints only
OFFICIAL = ["--qwen-kv-reuse-template", "false"]  # the model's own (official Qwen3.5) template
HYBRID_MODES = {  # name -> (launcher flags, environment); every server is the launcher on --model qwen36-demo
    "product": (OFFICIAL, {}),  # --prefix-match-unit 16 (the launcher's) + the extension's turn checkpoints
    "stock": ([*OFFICIAL, "--prefix-match-unit", "640"], HYBRID_OFF),  # vLLM's default unit: the 640-token block
    "unit16": (OFFICIAL, HYBRID_OFF),  # stock with --prefix-match-unit 16 (retention 0: semantic checkpoints only)
    "dense": ([*OFFICIAL, "--prefix-cache-retention-interval", "None"], HYBRID_OFF),  # + every block's state kept
    "no-cache": ([*OFFICIAL, "--no-enable-prefix-caching"], HYBRID_OFF),  # the no-reuse baseline
    "product-aa": (OFFICIAL, {}),  # product again: the A/A row (how much TTFT moves between identical servers)
}
# --answers generated: the model writes the answers and they are fed back as generated
HYBRID_GENERATED_MODES = {
    "product": ([], {}),  # the launcher's defaults: qwen3.5-reuse template + turn and answer checkpoints
    "reuse-template": ([], HYBRID_OFF),  # the prefix-stable template with vLLM's own checkpoints (unit 16)
    "reuse-template-dense": (["--prefix-cache-retention-interval", "None"], HYBRID_OFF),  # + every block's state
    "unit16": (OFFICIAL, HYBRID_OFF),  # vLLM's best configuration with the official template
    "dense": ([*OFFICIAL, "--prefix-cache-retention-interval", "None"], HYBRID_OFF),
    "no-cache": ([*OFFICIAL, "--no-enable-prefix-caching"], HYBRID_OFF),
    "product-aa": ([], {}),
    # the launcher's defaults before issue 48's sweep: reasoning of earlier turns kept too (preserve_thinking true)
    "product-preserve": (["--default-chat-template-kwargs", '{"preserve_thinking": true}'], {}),
    "answers-off": (["--qwen-kv-answer-checkpoints", "false"], {}),  # the launcher's defaults but this one
    "answers-off-aa": (["--qwen-kv-answer-checkpoints", "false"], {}),
}
# --saturation: answer checkpoints on and off, each against itself (the A/A pairs), in ABBA order per round so a drift
# in the machine's speed hits both sides alike
SATURATION_SIDES = ("product", "answers-off", "answers-off-aa", "product-aa")
HYBRID_ANSWERS = (20, 80, 200, 400, 600)  # answer lengths (tokens), cycled per turn, shifted per conversation
HYBRID_UNIT = 16


def hybrid_conversation(seed: int, turns: int) -> list[list[dict]]:
    """One conversation's requests: a 200-token system prompt, user turns of 60-150 tokens, canned answers of
    :data:`HYBRID_ANSWERS` tokens fed back as ``content``."""
    from qwen_vllm_ext.bench.prompts import PromptFactory

    pf = PromptFactory(seed=seed, template="qwen3.5", model="qwen3.6")
    msgs = [{"role": "system", "content": pf.text(200)}, {"role": "user", "content": pf.text(60 + 10 * (seed % 10))}]
    out = [list(msgs)]
    for t in range(1, turns):
        answer = HYBRID_ANSWERS[(t + seed) % len(HYBRID_ANSWERS)]
        msgs = msgs + [{"role": "assistant", "content": pf.text(answer)},
                       {"role": "user", "content": pf.text(60 + (37 * t + 11 * seed) % 91)}]
        out.append(list(msgs))
    return out


def hybrid_words() -> dict[int, str]:
    """Single-token words of the Qwen3.5/3.6 vocabulary (id -> text): a generated sequence of them re-tokenizes to
    the very ids generated, as a real model's ordinary text does."""
    from qwen_v3_calculator.tokenizer import Tokenizer

    tok = Tokenizer.bundled("qwen3.6")
    words = {}
    for w in WORDS:
        enc = tok.encode(w)
        if len(enc) == 1:
            words[enc[0]] = w
    assert len(words) >= 16, words
    return words


class GeneratedConversation:
    """One conversation whose answers the model writes: greedy, single-token words only (``allowed_token_ids``),
    ``answers`` tokens long, cycled per turn (:data:`HYBRID_ANSWERS` by default; ``ignore_eos``), fed back as a
    client gets it from vLLM's reasoning parser: ``content`` and ``reasoning_content`` (thinking on, the words never
    close the think block, so all of it is reasoning; thinking off, all of it is content). A 200-token system
    prompt, user turns of 60-150 tokens.
    :meth:`turn` runs the next request and returns :func:`chat_turn`'s fields (without ids, text and reasoning)
    plus ``shared`` (common prefix of the previous prompt + generated ids with this prompt), ``bound`` (the most a
    cache can give: the shared part the engine computed -- not the last generated token, never fed back -- floored
    to the match unit) and ``prev_seen`` (the previous prompt + generated ids)."""

    def __init__(self, conv_id: str, seed: int, thinking: bool, words: dict[int, str],
                 template_kwargs: dict | None = None, answers: tuple[int, ...] = HYBRID_ANSWERS):
        from qwen_vllm_ext.bench.prompts import PromptFactory

        self.conv_id, self.seed, self.thinking, self.words = conv_id, seed, thinking, words
        self.template_kwargs = template_kwargs or {}  # besides enable_thinking (e.g. preserve_thinking)
        self.answers = answers
        self.pf = PromptFactory(seed=seed, template="qwen3.5", model="qwen3.6")
        self.messages = [{"role": "system", "content": self.pf.text(200)}]
        self.prev: list[int] = []
        self.t = 0

    def turn(self, client: httpx.Client) -> dict:
        t, seed = self.t, self.seed
        self.messages.append({"role": "user", "content": self.pf.text(60 + (37 * t + 11 * seed) % 91)})
        length = self.answers[(t + seed) % len(self.answers)]
        body = {"model": HYBRID_MODEL, "messages": list(self.messages), "max_tokens": length, "ignore_eos": True,
                "temperature": 0, "allowed_token_ids": list(self.words), "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "chat_template_kwargs": {**self.template_kwargs, "enable_thinking": self.thinking}}
        turn = chat_turn(client, body, {"x-session-id": self.conv_id})
        ids, gen = turn.pop("prompt_ids"), turn.pop("gen_ids")
        assert turn["prompt_tokens"] == len(ids) and len(gen) == length
        shared = common_prefix(self.prev, ids)
        computed = max(len(self.prev) - 1, 0)
        text, reasoning = turn.pop("text"), turn.pop("reasoning")
        assert text + reasoning == "".join(self.words[i] for i in gen)
        turn.update(shared=shared, bound=min(shared, computed) // HYBRID_UNIT * HYBRID_UNIT,
                    prev_seen=len(self.prev))
        self.prev = ids + gen
        assistant = {"role": "assistant", "content": text}
        if reasoning:
            assistant["reasoning_content"] = reasoning
        self.messages.append(assistant)
        self.t += 1
        return turn


def generated_conversation(client: httpx.Client, conv_id: str, seed: int, turns: int, thinking: bool,
                           words: dict[int, str], template_kwargs: dict | None = None,
                           answers: tuple[int, ...] = HYBRID_ANSWERS) -> list[dict]:
    """``turns`` turns of a :class:`GeneratedConversation`, one per request."""
    conversation = GeneratedConversation(conv_id, seed, thinking, words, template_kwargs, answers)
    return [conversation.turn(client) for _ in range(turns)]


def hybrid_turn(client: httpx.Client, conv_id: str, messages: list[dict], thinking: bool, prev_ids: list[int]) -> dict:
    """One request; ``shared``: its prompt ids' common prefix with ``prev_ids`` (the previous request's prompt),
    ``bound``: shared floored to the match unit; ``ids``: its prompt ids."""
    body = {"model": HYBRID_MODEL, "messages": messages, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": thinking}}
    turn = chat_turn(client, body, {"x-session-id": conv_id})
    ids = turn.pop("prompt_ids")
    assert turn["prompt_tokens"] == len(ids)
    shared = common_prefix(prev_ids, ids)
    for k in ("gen_ids", "text", "reasoning"):
        turn.pop(k)
    turn.update(shared=shared, bound=shared // HYBRID_UNIT * HYBRID_UNIT, ids=ids)
    return turn


def run_hybrid_conversations(base_url: str, prefix: str, convos: list[list[list[dict]]], thinking: bool,
                             interleave: bool = False) -> list[list[dict]]:
    """Each conversation's turns, one after the other (``interleave``: turn 1 of every conversation, then turn 2,
    ... each round in a seeded random order -- conversations compete for the cache; a fixed round-robin order would
    be LRU's worst case, every entry evicted just before its reuse)."""
    import random

    runs: list[list[dict]] = [[] for _ in convos]
    if interleave:
        rng = random.Random(len(convos))
        order = [(t, c) for t in range(len(convos[0])) for c in rng.sample(range(len(convos)), len(convos))]
    else:
        order = [(t, c) for c in range(len(convos)) for t in range(len(convos[c]))]
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for t, c in order:
            prev = runs[c][-1]["ids"] if runs[c] else []
            runs[c].append(hybrid_turn(client, f"{prefix}-{c}", convos[c][t], thinking, prev))
    for run in runs:
        for turn in run:
            turn.pop("ids")
    return runs


def summarize_hybrid(runs: list[list[dict]]) -> dict:
    rows = [r for run in runs for r in run]
    later = [r for run in runs for r in run[1:]]
    ttft3 = [1000 * r["ttft_s"] for run in runs for r in run[2:] if r["ttft_s"] is not None]
    return {"prompt_tokens": sum(r["prompt_tokens"] for r in rows), "cached": sum(r["cached_tokens"] for r in rows),
            "computed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows),
            "output_tokens": sum(r["completion_tokens"] for r in rows),
            "bound": sum(r["bound"] for r in later), "shared": sum(r["shared"] for r in later),
            "turns_at_bound": sum(1 for r in later if r["cached_tokens"] == r["bound"]),
            "turns_below_bound": sum(1 for r in later if r["cached_tokens"] < r["bound"]), "turns": len(later),
            "ttft_ms_turn3_mean": sum(ttft3) / len(ttft3) if ttft3 else None,
            "ttft_ms_turn3_p99": percentile(ttft3, 99),
            # decode time per generated token after the first (answer checkpoints copy a state every 16 tokens)
            "decode_ms_per_token": decode_ms_per_token(rows),
            # generated answers: turns whose computed prefill is at most what is new since the previous request
            # (the user message and template tokens) plus one match unit -- the previous answer was reused
            "turns_new_plus_unit": sum(1 for r in later if "prev_seen" in r and
                                       r["prompt_tokens"] - r["cached_tokens"]
                                       <= r["prompt_tokens"] - r["prev_seen"] + HYBRID_UNIT)}


def decode_ms_per_token(rows: list[dict]) -> float | None:
    timed = [r for r in rows if r.get("elapsed_s") is not None and r["ttft_s"] is not None
             and r["completion_tokens"] > 1]
    tokens = sum(r["completion_tokens"] - 1 for r in timed)
    return 1000 * sum(r["elapsed_s"] - r["ttft_s"] for r in timed) / tokens if tokens else None


def run_generated_conversations(base_url: str, prefix: str, conversations: int, turns: int,
                                thinking: bool, seed0: int = 0, interleave: bool = False,
                                answers: tuple[int, ...] = HYBRID_ANSWERS) -> list[list[dict]]:
    """``conversations`` :class:`GeneratedConversation` s (seeds from ``seed0``, distinct per thinking mode, answer
    lengths cycled from ``answers``), one after the other, or ``interleave``d as in :func:`run_hybrid_conversations`."""
    import random

    words = hybrid_words()
    convos = [GeneratedConversation(f"{prefix}-{m}", seed0 + m + (0 if thinking else 1000), thinking, words,
                                    answers=answers) for m in range(conversations)]
    if interleave:
        rng = random.Random(conversations)
        order = [c for _ in range(turns) for c in rng.sample(range(conversations), conversations)]
    else:
        order = [c for c in range(conversations) for _ in range(turns)]
    runs: list[list[dict]] = [[] for _ in convos]
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for c in order:
            runs[c].append(convos[c].turn(client))
    return runs


def saturation_run(server: ServeProcess, seed0: int, clients: int, turns: int, words: dict[int, str]) -> dict:
    """``clients`` concurrent clients, each one :class:`GeneratedConversation` of ``turns`` turns (thinking off,
    answers of 20-600 tokens fed back as generated), against one server; its running and waiting requests sampled
    from ``/metrics`` every 0.5 s. Output throughput: completion tokens over the wall time of the whole run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"]
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                samples.append(server.metrics(names))
            except OSError:  # the server is gone: the clients report why
                return
            stop.wait(0.5)

    def client(conversation: GeneratedConversation) -> list[dict]:
        # a connection per request: a kept-alive one can be closed by the server just as the next turn goes out on
        # it ("Server disconnected without sending a response"), and a request is never retried (no double count)
        with httpx.Client(base_url=server.base_url, timeout=600,
                          limits=httpx.Limits(max_keepalive_connections=0)) as http:
            return [conversation.turn(http) for _ in range(turns)]

    convos = [GeneratedConversation(f"sat-{seed0}-{c}", seed0 + c, False, words) for c in range(clients)]
    preempted = server.metric("vllm:num_preemptions_total") or 0.0
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(client, convos))
    wall = time.monotonic() - start
    stop.set()
    sampler.join()
    rows = [r for run in runs for r in run]
    ttft = [1000 * r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    running = [s["vllm:num_requests_running"] or 0 for s in samples]
    waiting = [s["vllm:num_requests_waiting"] or 0 for s in samples]
    out = sum(r["completion_tokens"] for r in rows)
    return {"wall_s": wall, "output_tokens": out, "output_tok_s": out / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows), "cached": sum(r["cached_tokens"] for r in rows),
            "running_mean": sum(running) / len(running), "running_max": max(running),
            "waiting_mean": sum(waiting) / len(waiting),
            "preemptions": int((server.metric("vllm:num_preemptions_total") or 0.0) - preempted),
            "ttft_ms_mean": sum(ttft) / len(ttft), "ttft_ms_p99": percentile(ttft, 99), "raw": runs}


def run_saturation(args) -> int:
    """Issue 48 item 3: at a concurrency where the cache limits the running requests, output throughput and running
    requests with answer checkpoints on and off, each side against itself first (:data:`SATURATION_SIDES`, all four
    servers resident, one busy at a time). Per round every side runs the same workload (seeds new per round);
    ratios per round, 95% intervals over the rounds (:func:`qwen_vllm_ext.bench.paired.ratio_interval`)."""
    from qwen_vllm_ext.bench.paired import ratio_interval

    words = hybrid_words()
    tmp = tempfile.mkdtemp(prefix="bench-kv-saturation-")
    pressure = ["--num-gpu-blocks-override", str(args.kv_blocks)] if args.kv_blocks else []
    servers = {}
    try:
        for side in SATURATION_SIDES:
            flags, env = HYBRID_GENERATED_MODES[side]
            servers[side] = ServeProcess(["--model", HYBRID_MODEL, "--qwen-data-dir", os.path.join(tmp, side), *flags,
                                          *pressure], os.path.join(tmp, f"{side}.log"), env={**os.environ, **env},
                                         cwd=ROOT, label=side)
        for server in servers.values():
            server.wait_healthy()
        results: dict = {"config": {**vars(args), "sides": SATURATION_SIDES}, "rounds": []}
        t0 = time.monotonic()
        for r in range(args.saturation):
            order = SATURATION_SIDES if r % 2 == 0 else SATURATION_SIDES[::-1]
            row = {}
            for side in order:
                row[side] = saturation_run(servers[side], 5000 + 100 * r, args.concurrency, args.turns, words)
                print(f"[{time.monotonic() - t0:6.1f}s] round {r + 1} {side}: {row[side]['output_tok_s']:.1f} tok/s, "
                      f"running {row[side]['running_mean']:.2f}, preempted {row[side]['preemptions']}",
                      file=sys.stderr)
            results["rounds"].append(row)
    finally:
        for server in servers.values():
            server.stop()
    pairs = {"A/A on (product-aa / product)": ("product-aa", "product"),
             "A/A off (answers-off-aa / answers-off)": ("answers-off-aa", "answers-off"),
             "on / off (product / answers-off)": ("product", "answers-off"),
             "on / off, second servers (product-aa / answers-off-aa)": ("product-aa", "answers-off-aa")}
    results["ratios"] = {
        name: {metric: ratio_interval([row[a][metric] / row[b][metric] for row in results["rounds"]
                                       if row[b][metric]])
               for metric in ("output_tok_s", "running_mean", "ttft_ms_mean")}
        for name, (a, b) in pairs.items()}
    report_saturation(results, args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def report_saturation(results: dict, args) -> None:
    print(f"\nSaturation on the hybrid demo: {args.concurrency} concurrent conversations x {args.turns} turns "
          f"(thinking off, generated answers of 20-600 tokens), {args.kv_blocks or 'the profile'}'s KV blocks, "
          f"{len(results['rounds'])} rounds\n")
    print("| side | output tok/s (per round) | running requests, mean (max) | waiting, mean | preemptions | "
          "cached tokens | TTFT mean ms |")
    print("|---|---|---|---|---|---|---|")
    for side in SATURATION_SIDES:
        rows = [row[side] for row in results["rounds"]]

        def cell(key: str, fmt: str, rows=rows) -> str:
            return " / ".join(format(r[key], fmt) for r in rows)

        running = " / ".join("{:.2f} ({:.0f})".format(r["running_mean"], r["running_max"]) for r in rows)
        print(f"| {side} | {cell('output_tok_s', '.1f')} | {running} | {cell('waiting_mean', '.2f')} | "
              f"{cell('preemptions', 'd')} | {cell('cached', 'd')} | {cell('ttft_ms_mean', '.0f')} |")
    print("\n| ratio | output tok/s | running requests | TTFT mean |")
    print("|---|---|---|---|")
    for name, metrics in results["ratios"].items():
        cells = [f"{m['point']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]" for m in metrics.values()]
        print(f"| {name} | {' | '.join(cells)} |")


def run_hybrid(args) -> int:
    from qwen_vllm_ext.demo import HYBRID_CONFIG
    from qwen_vllm_ext.kv.checkpoints import state_bytes

    generated = args.answers == "generated"
    out = args.out if args.out != os.path.join(RESULTS, "bench_kv_reuse.json") else \
        os.path.join(RESULTS, "bench_kv_reuse-hybrid-generated.json" if generated else "bench_kv_reuse-hybrid.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # distinct conversations per thinking mode: one server serves both, and no run may hit another's prefixes
    convos = {thinking: [hybrid_conversation(m + (0 if thinking else 1000), args.turns)
                         for m in range(args.conversations)] for thinking in (True, False)}
    modes = HYBRID_GENERATED_MODES if generated else HYBRID_MODES
    results: dict = {"config": {**vars(args), "answers": HYBRID_ANSWERS, "unit": HYBRID_UNIT},
                     "state": state_bytes(HYBRID_CONFIG, block_align=128), "modes": {}}
    tmp = tempfile.mkdtemp(prefix="bench-kv-reuse-hybrid-")
    t0 = time.monotonic()
    for mode in args.modes.split(","):
        flags, env = modes[mode]
        pressure = ["--num-gpu-blocks-override", str(args.kv_blocks)] if args.kv_blocks else []
        server = ServeProcess(["--model", HYBRID_MODEL, "--qwen-data-dir", os.path.join(tmp, mode), *flags, *pressure],
                              os.path.join(tmp, f"{mode}.log"), env={**os.environ, **env}, cwd=ROOT, label=mode)
        try:
            server.wait_healthy()
            results["modes"][mode] = {"flags": flags, "env": env}
            for thinking in ((True,) if args.thinking_on_only else (False,) if args.thinking_off_only else (True, False)):
                key = f"thinking-{'on' if thinking else 'off'}"
                preempted, wall = server.metric("vllm:num_preemptions_total") or 0.0, time.monotonic()
                if generated:
                    runs = run_generated_conversations(server.base_url, f"{mode}-{key}", args.conversations,
                                                       args.turns, thinking, interleave=args.interleave)
                else:
                    runs = run_hybrid_conversations(server.base_url, f"{mode}-{key}", convos[thinking], thinking,
                                                    interleave=args.interleave)
                total = summarize_hybrid(runs)
                wall = time.monotonic() - wall
                # requests go one at a time, so output throughput is what one stream gets; preemptions come from
                # vLLM's own counter (a turn that does not fit the cache beside the kept states is preempted)
                total.update(preemptions=int((server.metric("vllm:num_preemptions_total") or 0.0) - preempted),
                             wall_s=wall, output_tokens_per_s=total["output_tokens"] / wall)
                results["modes"][mode][key] = {"total": total, "raw": runs}
            print(f"[{time.monotonic() - t0:6.1f}s] {mode} done", file=sys.stderr)
        finally:
            server.stop()
    results["elapsed_s"] = time.monotonic() - t0
    report_hybrid(results, args)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    png = os.path.splitext(out)[0] + ".png"
    drawn = plot_hybrid(png, results)
    print(f"\nwrote {out}" + (f" and {png}" if drawn else ""), file=sys.stderr)
    return 0


def report_hybrid(results: dict, args) -> None:
    modes = list(results["modes"])
    generated = args.answers == "generated"
    answers = ("generated answers (fed back as generated; templates per mode)" if generated
               else "official Qwen3.5 template, canned answers")
    print(f"\nKV reuse on the hybrid demo ({HYBRID_MODEL}), {answers}, {args.conversations} "
          f"conversations x {args.turns} turns, answers {'/'.join(map(str, HYBRID_ANSWERS))} tokens, "
          f"{results['elapsed_s']:.0f} s\n")
    print("| thinking | mode | prompt tokens | cached | computed prefill | vs no-cache | vs unit16 | "
          "turns cached to the shared prefix | below it | hit rate | TTFT turns 3+ mean / p99 ms | decode ms/token |"
          " preemptions | output tok/s |" + (" computed ≤ new tokens + 16 |" if generated else ""))
    print("|---" * (15 if generated else 14) + "|")
    for key in ("thinking-on", "thinking-off"):
        if key not in results["modes"][modes[0]]:
            continue
        base = results["modes"].get("no-cache", {}).get(key, {}).get("total", {}).get("computed")
        best = results["modes"].get("unit16", {}).get(key, {}).get("total", {}).get("computed")
        for mode in modes:
            t = results["modes"][mode][key]["total"]
            fewer = f"−{100 * (1 - t['computed'] / base):.1f}%" if base else "—"
            vs = f"{t['computed'] / best:.3f}×" if best else "—"
            ttft = "—" if t["ttft_ms_turn3_mean"] is None else \
                f"{t['ttft_ms_turn3_mean']:.1f} / {t['ttft_ms_turn3_p99']:.1f}"
            decode = "—" if t.get("decode_ms_per_token") is None else f"{t['decode_ms_per_token']:.2f}"
            new_unit = f" | {t['turns_new_plus_unit']}/{t['turns']}" if generated else ""
            # hit rate: cached ÷ the tokens each turn shares with its conversation's previous request (older JSONs
            # lack the run's preemptions and throughput: "—")
            hit = f"{t['cached'] / t['shared']:.3f}" if t["shared"] else "—"
            preempt = t.get("preemptions", "—")
            tps = f"{t['output_tokens_per_s']:.1f}" if "output_tokens_per_s" in t else "—"
            print(f"| {key[9:]} | {mode} | {t['prompt_tokens']} | {t['cached']} | {t['computed']} | {fewer} | {vs} | "
                  f"{t['turns_at_bound']}/{t['turns']} | {t['turns_below_bound']} | {hit} | {ttft} | {decode} | "
                  f"{preempt} | {tps}{new_unit} |")


def plot_hybrid(path: str, results: dict) -> bool:
    panels = _two_panels()
    if panels is None:
        return False
    plt, fig, axes = panels
    for key, ax in zip(("thinking-on", "thinking-off"), axes):
        for mode, data in results["modes"].items():
            if key not in data:
                continue
            runs = data[key]["raw"]
            turns = len(runs[0])
            computed = [sum(r[t]["prompt_tokens"] - r[t]["cached_tokens"] for r in runs) for t in range(turns)]
            # repeated and equal-by-construction rows are dashed so the lines under them stay visible
            style = "--" if mode in ("product-aa", "dense") else "-"
            ax.plot(range(1, turns + 1), computed, style, marker="o", ms=3, label=mode)
        ax.set_title(f"hybrid demo: computed prefill tokens per turn, {key.replace('-', ' ')}")
        ax.set_xlabel("turn")
        ax.set_ylabel("prompt − cached tokens (sum over conversations)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    raise SystemExit(main())
