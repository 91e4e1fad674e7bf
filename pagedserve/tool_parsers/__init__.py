"""Tool calling: parsers that find tool calls in a model's output (`--tool-call-parser`), and the calls a grammar
forced (tool_choice "required" or a named function)."""
