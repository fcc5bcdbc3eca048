"""The references the calculator's chat renderers and counters are checked against: an official template text
rendered the way transformers' apply_chat_template (and so vLLM) renders it, and HF ``tokenizers``."""
from qwen_v3_calculator.chat import normalize_messages, normalize_tools

CONTENT_FORMAT = {"qwen2.5": "string", "qwen3": "string", "qwen3.5": "openai"}


def jinja_render(template_text, template, messages, tools, add_generation_prompt=True, enable_thinking=None,
                 **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    rendered, _ = render_jinja_template(
        conversations=[normalize_messages(messages, CONTENT_FORMAT[template])], tools=normalize_tools(tools),
        chat_template=template_text, add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


class HFAdapter:
    """HF ``tokenizers`` as a minimal tokenizer (``encode(str) -> list[int]``): the reference."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids
