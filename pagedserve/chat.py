"""`pagedserve chat`: an interactive terminal chat over LLMEngine, streaming tokens as they come.

With a TTY on stdin: a readline prompt with history, `/reset` (forget the conversation), `/exit`.
Without one: stdin is read as one user message and only the answer is printed.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from pagedserve.engine.input_processor import apply_chat_template
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams



def history_file() -> str:
    """The readline history of `pagedserve chat`, in the pagedserve cache folder."""
    from pagedserve.cache_directory import cache_root

    return os.path.join(cache_root(), "chat_history")


class ChatSession:
    """A conversation: messages so far, and a way to stream the assistant's next turn."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system_prompt: str | None = None) -> None:
        self.engine = engine
        self.params = params
        self.system_prompt = system_prompt
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def respond(self, user_message: str, on_text: Callable[[str], None]) -> str:
        """Add the user's message, stream the answer's text through `on_text`, return the whole answer."""
        self.messages.append({"role": "user", "content": user_message})
        prompt_ids = apply_chat_template(self.engine.tokenizer, self.messages, add_generation_prompt=True)
        request_id = self.engine.next_request_id()
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, self.params, output_kind="delta")
        pieces: list[str] = []
        try:
            finished = False
            while not finished:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    delta = output.outputs[0].text
                    if delta:
                        pieces.append(delta)
                        on_text(delta)
                    finished = output.finished
        except BaseException:
            self.engine.abort_request([request_id])
            self.messages.pop()
            raise
        answer = "".join(pieces)
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_chat(engine: LLMEngine, params: SamplingParams, system_prompt: str | None) -> int:
    session = ChatSession(engine, params, system_prompt)
    if not sys.stdin.isatty():
        message = sys.stdin.read().strip()
        if not message:
            print("error: empty message on stdin", file=sys.stderr)
            return 2
        session.respond(message, _write)
        _write("\n")
        return 0
    import readline

    history = history_file()
    os.makedirs(os.path.dirname(history), exist_ok=True)
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    print("pagedserve chat — /reset forgets the conversation, /exit quits.")
    try:
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                print()
                break
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                session.reset()
                print("(conversation reset)")
                continue
            try:
                session.respond(line, _write)
            except KeyboardInterrupt:
                print("\n(interrupted)")
                continue
            except ValueError as error:  # e.g. the conversation outgrew max_model_len
                print(f"\nerror: {error}")
                session.messages.pop()
                continue
            _write("\n")
    finally:
        readline.write_history_file(history)
    return 0
