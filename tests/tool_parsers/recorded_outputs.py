"""Model outputs in each tool call format, as the models write them, with the calls and content a parser must
find. Malformed ones (a call that cannot parse) come back whole as content.

Each case: (parser name, output, expected calls as (name, arguments dict), expected content or None).
"""
from __future__ import annotations

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _deepseek_v3_call(name: str, arguments: str) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris"})
# The request's tools, which formats that write values as text (qwen3_coder) use to type them.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object", "properties": {
        "at": {"type": "object"}, "repeat": {"type": ["boolean", "null"]}, "volume": {"type": "number"},
        "label": {"type": "string"}}}}},
]

WELL_FORMED = {
    "hermes-one-call": (
        "hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                  '</tool_call>', [WEATHER], None),
    "hermes-content-then-two-calls": (
        "hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                  '{"timezone": "Europe/Paris"}}\n</tool_call>', [WEATHER, TIME], "Let me look that up.\n"),
    "hermes-no-end-tag": (
        "hermes", '<tool_call>\n{"arguments": {"timezone": "Europe/Paris"}, "name": "get_time"}\n', [TIME], None),
    "hermes-escaped-strings": (
        "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"ris} <tool_call>", '
                  '"unit": "\\u00b0C"}}</tool_call>',
        [("get_weather", {"city": 'Pa"ris} <tool_call>', "unit": "\u00b0C"})], None),
    "hermes-plain-answer": ("hermes", "Paris is sunny today.", [], "Paris is sunny today."),
    "qwen3-call-after-text": (
        "qwen3", 'I will check the time.\n\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
                 '"Europe/Paris"}}\n</tool_call>', [TIME], "I will check the time.\n\n"),
    "llama3-python-tag": (
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        [WEATHER], None),
    "llama3-two-calls": (
        "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                       '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}', [WEATHER, TIME], None),
    "llama3-plain-answer": ("llama3_json", "It is 12:00 in Paris.", [], "It is 12:00 in Paris."),
    "deepseek-v3-two-calls": (
        "deepseek_v3", "Checking." + DS_CALLS_BEGIN + _deepseek_v3_call("get_weather", '{"city": "Paris", "unit": '
                                                                        '"celsius"}') + "\n"
        + _deepseek_v3_call("get_time", '{"timezone": "Europe/Paris"}') + DS_CALLS_END, [WEATHER, TIME],
        "Checking."),
    "deepseek-alias": (
        "deepseek", DS_CALLS_BEGIN + _deepseek_v3_call("get_time", '{"timezone": "Europe/Paris"}') + DS_CALLS_END,
        [TIME], None),
    "qwen3-coder-typed-values": (
        "qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                       "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                       "<function=get_time>\n<parameter=timezone>\nEurope/Paris\n</parameter>\n</function>\n"
                       "</tool_call>", [("get_weather", {"city": "Paris", "days": 3}), TIME], "Let me check.\n"),
    "qwen3-coder-schema-types-and-missing-end-tags": (
        "qwen3_xml", "<tool_call>\n<function=set_alarm>\n<parameter=at>\n{\"hour\": 7, \"minute\": 30}\n"
                     "<parameter=repeat>\ntrue\n</parameter>\n<parameter=volume>\nloud\n</parameter>\n"
                     "<parameter=label>\n42\n</parameter>\n</function>\n</tool_call>",
        [("set_alarm", {"at": {"hour": 7, "minute": 30}, "repeat": True, "volume": "loud", "label": "42"})], None),
    "deepseek-v31": (
        "deepseek_v31", DS_CALLS_BEGIN + DS_CALL_BEGIN + 'get_time' + DS_SEP + '{"timezone": "Europe/Paris"}'
        + DS_CALL_END + DS_CALLS_END, [TIME], None),
}

MALFORMED = {
    "hermes-unquoted-name": ("hermes", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>'),
    "hermes-not-json": ("hermes", "Sure! <tool_call>get_weather(city='Paris')</tool_call>"),
    "hermes-arguments-not-an-object": (
        "hermes", '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),
    "hermes-no-name": ("hermes", '<tool_call>{"function": "get_weather", "arguments": {}}</tool_call>'),
    "qwen3-truncated-before-arguments": ("qwen3", '<tool_call>\n{"name": "get_'),
    "llama3-no-name": ("llama3_json", '{"parameters": {"city": "Paris"}}'),
    "qwen3-coder-text-between-parameters": (
        "qwen3_coder", "<tool_call>\n<function=get_time>\nnow\n<parameter=timezone>\nUTC\n</parameter>\n"
                       "</function>\n</tool_call>"),
    "qwen3-coder-no-function": ("qwen3_coder", "<tool_call>\n<parameter=timezone>\nUTC\n</parameter>\n</tool_call>"),
    "deepseek-v3-no-fence": (
        "deepseek_v3", DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + 'get_time {"timezone": "UTC"}'
        + DS_CALL_END + DS_CALLS_END),
}

# Malformed only after a call's name (and some arguments) went out: a stream cannot take those back, so it keeps
# the call as sent and sends nothing after it (vLLM's streams behave alike); the whole answer is content.
MALFORMED_AFTER_A_CALL_STREAMED = {
    "hermes-two-objects-in-one-block": (
        "hermes", '<tool_call>{"name": "get_time", "arguments": {}} {"name": "get_time", "arguments": {}}'
                  '</tool_call>', ("get_time", "{}")),
    "llama3-bad-separator": (
        "llama3_json", '{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}',
        ("get_time", "{}")),
    "deepseek-v3-bad-json": (
        "deepseek_v3", DS_CALLS_BEGIN + _deepseek_v3_call("get_time", '{"timezone": UTC}') + DS_CALLS_END,
        ("get_time", '{"timezone": UTC}')),
}

# Outputs a grammar forced (tool_choice "required": an array of calls; a named function: its arguments).
REQUIRED = {
    "two-calls": ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                  '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]', [WEATHER, TIME]),
    "one-call-no-spaces": ('[{"name":"get_time","parameters":{"timezone":"Europe/Paris"}}]', [TIME]),
}
