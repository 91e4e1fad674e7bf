"""InputProcessor: tokenization, validation errors, max_tokens, EOS ids, n > 1 fan-out, chat template."""
from __future__ import annotations

import json
import types

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.input_processor import InputProcessor, apply_chat_template, prompt_text_of
from pagedserve.engine.parallel_sampling import ParentRequest, child_request_id
from pagedserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: str):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def processor(tokenizer) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=MAX_MODEL_LEN, eos_token_ids=[7])


def test_text_prompt_is_tokenized_with_special_tokens(processor: InputProcessor, tokenizer) -> None:
    (request,) = processor.process("r", "Hello world", SamplingParams(max_tokens=4))
    assert request.prompt_token_ids == tokenizer.encode("Hello world")
    assert request.prompt_token_ids[0] == tokenizer.bos_token_id
    assert request.request_id == "r" and request.eos_token_id == tokenizer.eos_token_id


def test_dict_prompts(processor: InputProcessor, tokenizer) -> None:
    (by_ids,) = processor.process("a", {"prompt_token_ids": [5, 6, 7], "cache_salt": "s"}, SamplingParams())
    assert by_ids.prompt_token_ids == [5, 6, 7] and by_ids.cache_salt == "s"
    (by_text,) = processor.process("b", {"prompt": "Hello"}, SamplingParams())
    assert by_text.prompt_token_ids == tokenizer.encode("Hello")
    assert prompt_text_of({"prompt": "Hello"}) == "Hello" and prompt_text_of({"prompt_token_ids": [1]}) is None
    assert prompt_text_of("x") == "x"


def test_max_tokens_none_fills_the_context(processor: InputProcessor) -> None:
    (request,) = processor.process("r", {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=None))
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    assert request.max_tokens == MAX_MODEL_LEN - 10


def test_user_params_are_not_changed(processor: InputProcessor) -> None:
    params = SamplingParams(max_tokens=None, n=2, seed=3)
    requests = processor.process("r", "Hello", params)
    assert params.max_tokens is None and params.n == 2 and params.seed == 3 and params.all_stop_token_ids == set()
    assert all(request.sampling_params is not params for request in requests)


def test_eos_ids_and_ignore_eos(processor: InputProcessor, tokenizer) -> None:
    (request,) = processor.process("r", "Hello", SamplingParams())
    assert request.sampling_params.all_stop_token_ids == {tokenizer.eos_token_id, 7}
    (ignoring,) = processor.process("s", "Hello", SamplingParams(ignore_eos=True))
    assert ignoring.sampling_params.all_stop_token_ids == set() and ignoring.eos_token_id is None


def test_empty_prompt(processor: InputProcessor) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        processor.process("r", {"prompt_token_ids": []}, SamplingParams())


@pytest.mark.parametrize("bad_id", [640, 10_000, -1])
def test_out_of_vocabulary_id(processor: InputProcessor, bad_id: int) -> None:
    with pytest.raises(ValueError) as error:
        processor.process("r", {"prompt_token_ids": [5, bad_id]}, SamplingParams())
    message = str(error.value)
    assert str(bad_id) in message and "640" in message and "vocab_size" in message


def test_non_integer_token_ids(processor: InputProcessor) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids contains 'a'"):
        processor.process("r", {"prompt_token_ids": [5, "a"]}, SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processor.process("r", {"prompt_token_ids": "abc"}, SamplingParams())


def test_prompt_too_long(processor: InputProcessor) -> None:
    with pytest.raises(ValueError) as error:
        processor.process("r", {"prompt_token_ids": [5] * MAX_MODEL_LEN}, SamplingParams(max_tokens=None))
    assert f"prompt has {MAX_MODEL_LEN} tokens" in str(error.value)
    assert f"max_model_len={MAX_MODEL_LEN}" in str(error.value)


def test_prompt_plus_max_tokens_too_long(processor: InputProcessor) -> None:
    with pytest.raises(ValueError) as error:
        processor.process("r", {"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=13))
    message = str(error.value)
    assert "20 tokens" in message and "max_tokens=13" in message and f"max_model_len={MAX_MODEL_LEN}" in message
    assert "max_tokens must be <= 12" in message
    # Exactly filling the context is fine.
    (request,) = processor.process("r", {"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=12))
    assert request.max_tokens == 12


def test_other_validation_errors(processor: InputProcessor) -> None:
    with pytest.raises(ValueError, match="prompt keys \\['images'\\]"):
        processor.process("r", {"prompt_token_ids": [5], "images": []}, SamplingParams())
    with pytest.raises(ValueError, match="prompt=123"):
        processor.process("r", 123, SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop_token_ids contains 999"):
        processor.process("r", "Hi", SamplingParams(stop_token_ids=[999]))
    with pytest.raises(ValueError, match="detokenize=True"):
        processor.process("r", "Hi", SamplingParams(stop=["x"], detokenize=False))
    with pytest.raises(ValueError, match="request_id"):
        processor.process("", "Hi", SamplingParams())
    with pytest.raises(ValueError, match="min_tokens=20 must be <= max_tokens=10"):
        processor.process("r", {"prompt_token_ids": [5] * 22}, SamplingParams(max_tokens=None, min_tokens=20))
    # Logprobs limits come from SamplingParams itself.
    with pytest.raises(ValueError, match="logprobs=21"):
        SamplingParams(logprobs=21)


def test_no_tokenizer_needs_token_ids() -> None:
    processor = InputProcessor(None, vocab_size=100, max_model_len=16)
    (request,) = processor.process("r", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4))
    assert request.sampling_params.all_stop_token_ids == set()
    with pytest.raises(ValueError, match="no tokenizer"):
        processor.process("r", "text", SamplingParams())


def test_fan_out_n_children_with_seeds(processor: InputProcessor) -> None:
    params = SamplingParams(n=3, seed=10, temperature=0.8, max_tokens=5, prompt_logprobs=2)
    children = processor.process("req", "Hello", params, priority=4)
    assert [child.request_id for child in children] == ["0_req", "1_req", "2_req"]
    assert [child.sampling_params.seed for child in children] == [10, 11, 12]
    assert all(child.sampling_params.n == 1 for child in children)
    assert all(child.priority == 4 and child.max_tokens == 5 for child in children)
    assert len({child.arrival_time for child in children}) == 1
    # The prompt's logprobs are computed once, by child 0.
    assert [child.sampling_params.prompt_logprobs for child in children] == [2, None, None]
    unseeded = processor.process("u", "Hello", SamplingParams(n=2))
    assert [child.sampling_params.seed for child in unseeded] == [None, None]
    parent = ParentRequest("req", params)
    assert parent.child_request_ids == [child_request_id(i, "req") for i in range(3)]
    with pytest.raises(ValueError, match="index=3"):
        parent.child_sampling_params(3)


def test_from_model_config_reads_generation_config(tmp_path, tokenizer) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, 9]}))
    model_config = types.SimpleNamespace(model=str(tmp_path), vocab_size=len(tokenizer), max_model_len=64)
    processor = InputProcessor.from_model_config(tokenizer, model_config)
    (request,) = processor.process("r", "Hi", SamplingParams())
    assert request.sampling_params.all_stop_token_ids == {tokenizer.eos_token_id, 9}


def test_constructor_validation(tokenizer) -> None:
    with pytest.raises(ValueError, match="max_model_len=1"):
        InputProcessor(tokenizer, vocab_size=10, max_model_len=1)
    with pytest.raises(ValueError, match="vocab_size=0"):
        InputProcessor(tokenizer, vocab_size=0, max_model_len=10)


def test_apply_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    text = apply_chat_template(tokenizer, messages, tokenize=False)
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    token_ids = apply_chat_template(tokenizer, messages)
    assert token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.bos_token_id not in token_ids  # no BOS added on top of the template
    plain = apply_chat_template(tokenizer, messages, add_generation_prompt=False, tokenize=False)
    assert plain == "<|im_start|>user\nHello<|im_end|>\n"
    custom = apply_chat_template(tokenizer, messages, chat_template="{{ messages[0]['content'] }}!", tokenize=False)
    assert custom == "Hello!"


def test_apply_chat_template_without_template(tiny_tokenizer_dir: str) -> None:
    bare = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bare, [{"role": "user", "content": "Hello"}])
    with pytest.raises(ValueError, match="messages="):
        apply_chat_template(bare, "Hello")  # type: ignore[arg-type]
