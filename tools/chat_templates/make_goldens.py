"""Render every template in tests/chat_templates/ with transformers and record the prompts.

Run by hand from the repository root (no network needed):

    .venv/bin/python tools/chat_templates/make_goldens.py

For each template and each conversation below, with add_generation_prompt false and true (and the
template's extra arguments, e.g. Qwen3's enable_thinking), this calls transformers'
`apply_chat_template(..., tokenize=False)` on a tokenizer that carries exactly the model's named
special tokens, and writes tests/chat_templates/goldens.json. A conversation the template refuses
through `raise_exception` is recorded with the message instead of a prompt; moerun-text must refuse
it with the same message. Messages, tools and extra arguments are stored as JSON text so that the
Rust side reads their keys in the order written here, as Python does.
"""

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "tests" / "chat_templates"

# The named special tokens each model's tokenizer_config.json sets.
SPECIALS = {
    "chatml": {"eos_token": "<|im_end|>"},
    "gemma2": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    "llama3_1": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral_7b_instruct": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mistral_nemo": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "mixtral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "smollm2": {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    },
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city (temp\u00e9rature incluse).",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["location"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}

SYSTEM = {"role": "system", "content": "You are a concise assistant. R\u00e9ponds en fran\u00e7ais si on te le demande."}
CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello! How are you?"}],
    "multi_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "  And of Japan? \u65e5\u672c\u8a9e\u3067\u3002 \U0001F600  "},
    ],
    "system_multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Give me a haiku."},
        {"role": "assistant", "content": "Autumn moonlight\u2014\na worm digs silently\ninto the chestnut."},
        {"role": "user", "content": "Another, please.\n"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi!"},
    ],
}
# Conversations only templates with tool support are asked to render. The assistant's tool-call
# turn has content "" here; tool_call_null_content (below) sends it as null, which transformers
# drops, and which Qwen3's original template cannot render (it reads message.content).
TOOL_CONVERSATIONS = {
    "tool_call_round_trip": [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris in celsius?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call12345",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call12345", "content": '{"temperature": 22.5, "sky": "clear"}'},
        {"role": "assistant", "content": "It is 22.5\u00b0C and clear in Paris."},
        {"role": "user", "content": "Thanks!"},
    ],
}
TOOL_CONVERSATIONS["tool_call_null_content"] = [
    dict(m, content=None) if m.get("tool_calls") else m for m in TOOL_CONVERSATIONS["tool_call_round_trip"]
]
# Qwen3 only: reasoning passed separately and inline, and content given as a list of parts.
QWEN3_CONVERSATIONS = {
    "reasoning_content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Simple arithmetic.", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6"},
    ],
    "reasoning_under_another_name": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning": "Greet back.", "content": "Hello!"},
    ],
    "multi_tool_calls_string_arguments": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Tokyo"}}},
            ],
        },
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "25C"},
    ],
}
GEMMA3_CONVERSATIONS = {
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Describe images briefly."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]},
    ],
}

# Per template: extra conversations, extra argument sets, and whether tools are supported.
PLANS = {
    "chatml": {},
    "gemma2": {},
    "gemma3": {"conversations": GEMMA3_CONVERSATIONS},
    "llama3": {},
    "llama3_1": {
        "tools": True,
        "extras": [{}, {"date_string": "05 Mar 2025"}, {"tools_in_user_message": False}],
    },
    "mistral_7b_instruct": {},
    "mistral_nemo": {"tools": True},
    "mixtral": {},
    "qwen3": {
        "tools": True,
        "conversations": QWEN3_CONVERSATIONS,
        "extras": [{}, {"enable_thinking": True}, {"enable_thinking": False}],
    },
    "smollm2": {},
}


def host_tokenizer(specials: dict) -> PreTrainedTokenizerFast:
    """A tokenizer whose special_tokens_map is exactly `specials`: what the template sees."""
    vocab = {"<placeholder>": 0}
    for i, token in enumerate(specials.values(), start=1):
        vocab.setdefault(token, i)
    backend = Tokenizer(WordLevel(vocab, unk_token="<placeholder>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def render(tok, template, messages, tools, add_generation_prompt, extra):
    try:
        prompt = tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )
        return {"expected": prompt}
    except jinja2.exceptions.TemplateError as e:
        if type(e) is not jinja2.exceptions.TemplateError:
            raise  # an UndefinedError or syntax error is a broken case, not a refusal
        return {"expected_error": str(e)}


def main() -> None:
    cases = []
    skipped = []
    for name, plan in sorted(PLANS.items()):
        template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        specials = SPECIALS[name]
        tok = host_tokenizer(specials)
        assert tok.special_tokens_map == specials, (name, tok.special_tokens_map)
        conversations = dict(CONVERSATIONS)
        conversations.update(plan.get("conversations", {}))
        tool_sets = [None]
        if plan.get("tools"):
            conversations.update(TOOL_CONVERSATIONS)
            tool_sets.append([WEATHER_TOOL, SEARCH_TOOL])
        for conv_name, messages in conversations.items():
            for tools in tool_sets:
                for extra in plan.get("extras", [{}]):
                    for agp in (False, True):
                        case_name = f"{name}/{conv_name}/tools={'yes' if tools else 'no'}/agp={agp}"
                        if extra:
                            case_name += "/" + ",".join(f"{k}={v}" for k, v in extra.items())
                        try:
                            result = render(tok, template, messages, tools, agp, extra)
                        except jinja2.exceptions.UndefinedError as e:
                            # The template cannot read this conversation at all (e.g. Qwen3's
                            # original template calls .startswith on a missing content); such
                            # input is outside what the template supports, so it is not a golden.
                            skipped.append(f"{case_name}: {e}")
                            continue
                        cases.append(
                            {
                                "name": case_name,
                                "template": f"{name}.jinja",
                                "special_tokens": list(specials.items()),
                                "messages_json": json.dumps(messages, ensure_ascii=False),
                                "tools_json": json.dumps(tools, ensure_ascii=False) if tools else None,
                                "add_generation_prompt": agp,
                                "extra_json": json.dumps(extra, ensure_ascii=False),
                                **result,
                            }
                        )
    out = TEMPLATES / "goldens.json"
    out.write_text(json.dumps({"cases": cases}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    refused = sum("expected_error" in c for c in cases)
    for line in skipped:
        print("not renderable by transformers either:", line)
    print(f"wrote {len(cases)} cases ({refused} refusals) to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
