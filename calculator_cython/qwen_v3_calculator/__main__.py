"""CLI: ``python -m qwen_v3_calculator count [FILE|-]`` and ``python -m qwen_v3_calculator chat FILE.json``.

``count`` prints the token count of a text file (``-`` or nothing: stdin); ``chat`` reads a JSON chat request
(``{"messages": [...], "tools": [...]}`` or a bare list of messages) and prints its exact prompt token count.
``--json`` prints the full ``calculate_tokens`` result (with billed units) instead. Exit status 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_v3_calculator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("count", "count the tokens of a text file or stdin"),
                           ("chat", "count the prompt tokens of a JSON chat request")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("file", nargs="?" if name == "count" else None, default="-")
        p.add_argument("--json", action="store_true", help="print calculate_tokens' full result as JSON")
        p.add_argument("--tokenizer", help="tokenizer.json or model directory (default: bundled Qwen3)")
        p.add_argument("--policy", default="default", help="billing policy preset")
        p.add_argument("--template", help="chat template family: qwen2.5, qwen3, qwen3.5, qwen3-reuse, qwen3.5-reuse")
    args = parser.parse_args(argv)

    from .calculator import Calculator, to_jsonable

    try:
        raw = sys.stdin.buffer.read() if args.file == "-" else open(args.file, "rb").read()
        text = raw.decode("utf-8")
        calc = Calculator(tokenizer=args.tokenizer, policy=args.policy, template=args.template)
        if args.command == "count":
            result = calc.calculate_tokens(input_text=text) if args.json else calc.count_tokens(text)
        else:
            request = json.loads(text)
            if isinstance(request, list):
                request = {"messages": request}
            if not isinstance(request, dict) or "messages" not in request:
                raise ValueError("chat input must be a JSON object with 'messages' or a list of messages")
            kwargs = {"tools": request.get("tools")}
            if args.json:
                result = calc.calculate_tokens(messages=request["messages"], **kwargs)
            else:
                result = calc.count_chat(request["messages"], **kwargs)
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        print(f"qwen_v3_calculator: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_jsonable(result), ensure_ascii=False, indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
