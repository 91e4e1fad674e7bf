"""The independent oracle: HF transformers' greedy generate on the same checkpoint."""
from __future__ import annotations

import torch


def hf_greedy_with_logprobs(folder: str, prompts: list[list[int]], max_new_tokens: int,
                            num_logprobs: int, dtype: torch.dtype = torch.float32,
                            ) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy-generate each prompt alone (no padding effects); return tokens and top-N logprobs per step.

    EOS does not stop generation (the engine side uses ignore_eos=True).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt):].tolist()
        assert len(tokens) == max_new_tokens
        step_logprobs = []
        for logits in out.logits:
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            top = torch.topk(logprobs, num_logprobs)
            step_logprobs.append(dict(zip(top.indices.tolist(), top.values.tolist())))
        results.append((tokens, step_logprobs))
    return results
