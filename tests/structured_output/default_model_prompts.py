"""The default model's settings and chat prompts for the structured-output tests (imported by name: a module
called conftest would clash with other folders' conftests when several test folders run in one pytest command)."""
from __future__ import annotations

# Small enough for 2 CPU cores; room for every request of the schema suite at once.
DEFAULT_MODEL_KWARGS = dict(max_model_len=1024, num_kv_blocks=512, block_size=16)


def chat_prompt(llm, question: str) -> dict:
    """The default model's chat-templated prompt for one user question."""
    from pagedserve.engine.input_processor import apply_chat_template

    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), [{"role": "user", "content": question}])}
