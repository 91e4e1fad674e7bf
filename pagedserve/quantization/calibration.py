"""Calibration for `pagedserve quantize`: the float model (HF transformers, float32) runs over a text file and each
linear layer's input is summarised per input channel.

One statistic serves every calibrated option: the largest |x| each input channel of a linear saw. SmoothQuant's
scales need it per channel (quantization/smoothquant.py); a static symmetric per-tensor activation scale is its
maximum over the channels (after smoothing: of the smoothed channels, |x_c| / s_c), which is why the raw (min, max)
of the input is not kept.
"""
from __future__ import annotations

import torch

# Tokens per forward pass of the calibration run (the text is cut into pieces of this length).
CALIBRATION_SEQUENCE_TOKENS = 512


def read_calibration_sequences(folder: str, calibration: str,
                               sequence_tokens: int = CALIBRATION_SEQUENCE_TOKENS) -> list[list[int]]:
    """The UTF-8 text file `calibration` tokenized with the tokenizer of the HF folder `folder`, in pieces of
    `sequence_tokens` tokens."""
    from transformers import AutoTokenizer

    with open(calibration, encoding="utf-8") as handle:
        text = handle.read()
    if not text.strip():
        raise ValueError(f"calibration={calibration!r}: the file is empty")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    token_ids = tokenizer(text)["input_ids"]
    return [token_ids[start:start + sequence_tokens] for start in range(0, len(token_ids), sequence_tokens)]


@torch.no_grad()
def collect_input_channel_absmax(folder: str, sequences: list[list[int]],
                                 names: list[str]) -> dict[str, torch.Tensor]:
    """For each linear module in `names`: float32 [in_features], the largest |input| of each input channel while the
    float32 HF model of `folder` ran over `sequences`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    absmax: dict[str, torch.Tensor] = {}
    handles = []
    wanted = set(names)
    for name, module in model.named_modules():
        if name not in wanted:
            continue

        def record(module: torch.nn.Module, args: tuple, name: str = name) -> None:
            inputs = args[0].detach().float()
            channel_absmax = inputs.reshape(-1, inputs.shape[-1]).abs().amax(dim=0)
            previous = absmax.get(name)
            absmax[name] = channel_absmax if previous is None else torch.maximum(previous, channel_absmax)

        handles.append(module.register_forward_pre_hook(record))
    try:
        for sequence in sequences:
            model(torch.tensor([sequence]))
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(wanted - set(absmax))
    if missing:
        raise ValueError(f"calibration: the model never ran the linear(s) {missing[:5]}; no statistics for them")
    return absmax


__all__ = ["CALIBRATION_SEQUENCE_TOKENS", "collect_input_channel_absmax", "read_calibration_sequences"]
