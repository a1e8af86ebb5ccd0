"""The built-in tokenizer's chat template: plain ChatML without tools, hermes tool calling with them."""

from posttrain.models.tiny import build_tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": [],
            },
        },
    }
]


def test_without_tools_the_template_is_plain_chatml():
    tok = build_tiny_tokenizer()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_tool_calls_and_tool_messages_render_hermes_style():
    tok = build_tiny_tokenizer()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "6"},
        {"role": "tool", "content": "7"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert text.count("<|im_start|>system") == 1  # the system message is merged into the tools turn
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
        in text
    )
    tail = "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
    assert text.endswith(tail + "<|im_start|>assistant\n")
