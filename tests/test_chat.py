"""ChatSession: multi-turn conversations through the chat template, streamed deltas, reset."""
from __future__ import annotations

from pagedserve import SamplingParams
from pagedserve.chat import ChatSession
from pagedserve.engine.input_processor import apply_chat_template
from pagedserve.engine.llm_engine import LLMEngine


def test_two_turns_stream_and_reset(tiny_model_dir) -> None:
    engine = LLMEngine.from_kwargs(tiny_model_dir("llama"), num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    session = ChatSession(engine, params, system_prompt="Be brief.")
    pieces: list[str] = []
    first = session.respond("Hello there", pieces.append)
    assert first == "".join(pieces)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    # The streamed answer equals a one-shot generation from the same templated prompt.
    prompt_ids = apply_chat_template(engine.tokenizer, session.messages[:2], add_generation_prompt=True)
    engine.add_request("check", {"prompt_token_ids": prompt_ids}, params, output_kind="final_only")
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final is not None and final.outputs[0].text == first
    session.respond("And again?", lambda _: None)
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]
    assert not engine.has_unfinished_requests()


def test_interactive_terminal_session(tiny_model_dir, tmp_path) -> None:
    """A real pseudo-terminal: prompt, streamed answer, /reset, /exit."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    leader, follower = pty.openpty()
    from pagedserve.kernels import cpu_library

    # readline history goes to a scratch home; the native kernels already built stay where they are (a fresh
    # cache would make the chat build them first: minutes on 2 cores)
    env = dict(os.environ, HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / ".cache"),
               **{cpu_library.CACHE_DIR_ENV: str(cpu_library.cache_root())})
    env.pop("PAGEDSERVE_CACHE_DIR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "chat", "--model", tiny_model_dir("llama"), "--num-kv-blocks", "64",
         "--max-model-len", "256", "--temperature", "0", "--max-tokens", "5", "--ignore-eos"],
        stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    transcript = b""

    def read_until(marker: bytes, timeout: float = 120.0) -> None:
        nonlocal transcript
        deadline = time.monotonic() + timeout
        while marker not in transcript:
            assert time.monotonic() < deadline, transcript.decode(errors="replace")
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    transcript += os.read(leader, 4096)
                except OSError:
                    break

    try:
        read_until(b"> ")
        os.write(leader, b"Hello there\n")
        transcript = transcript.split(b"Hello there", 1)[-1]
        read_until(b"> ")
        os.write(leader, b"/reset\n")
        read_until(b"(conversation reset)")
        os.write(leader, b"/exit\n")
        assert process.wait(timeout=60) == 0
        assert (tmp_path / ".cache" / "pagedserve" / "chat_history").read_text().splitlines()[-1] == "/exit"
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)
