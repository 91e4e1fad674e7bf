"""How far a W8A8 perplexity moves under perturbations the size of float32 rounding (issue #30).

A W8A8 model is not a continuous function of its input: every per-token int8 rounding is a step, so a last-bit
difference upstream moves some activation across a rounding boundary, that moves the layer's output by a whole
quantum, and the next layers' roundings follow it. Two correct implementations of the same arithmetic (the engine
and the plain float reference, tests/quantization/w8a8_reference.py) therefore give two different draws of the
rounding noise, and a perplexity over a few hundred tokens can land several percent apart. This recipe measures that
spread instead of comparing one draw with one draw: on the passage of tests/data (its first --tokens tokens, or all
of it), for each checkpoint, the perplexity by the engine (`LLM`, float32) and by the reference, unperturbed and
with the token embeddings multiplied by (1 + eps * N(0, 1)) for --seeds seeds (the same noise for both). The float
model is measured the same way as the control: a continuous model does not move at this eps.

Checkpoints (SmolLM2-135M-Instruct's GGUF weights dequantized to float32, `pagedserve quantize`): `plain` (every
linear int8), `ignore` (`--ignore 're:.*down_proj$'`), `smoothquant` (that plus `--smoothquant-alpha 0.5
--calibration tests/data/calibration_text.txt`). The float folder and `plain` are the cached ones of w8a8_decode.py;
the others are written under --work (a new folder under /tmp by default).

    python benchmarks/w8a8_perplexity_spread.py [--tokens 400|all] [--seeds 4] [--eps 1e-7] \
        [--checkpoints plain ignore smoothquant] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "quantization"))
sys.path.insert(0, os.path.join(HERE, ".."))

from perplexity import passage_text  # noqa: E402
import native_guard  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

CALIBRATION = os.path.join(HERE, "..", "tests", "data", "calibration_text.txt")
KEPT = r"re:.*down_proj$"
ENGINE = dict(dtype="float32", max_model_len=4096, num_kv_blocks=260)  # the passage in one request


def checkpoint_folders(names: list[str], work: str) -> tuple[str, dict[str, str]]:
    """(the float32 HF folder, {name: W8A8 folder}) for the checkpoints named (see the module docstring)."""
    from w8a8_decode import smollm2_folders

    from pagedserve.quantization.quantize_checkpoint import quantize_checkpoint

    source, plain = smollm2_folders()
    options = {"ignore": dict(ignore=[KEPT]),
               "smoothquant": dict(ignore=[KEPT], smoothquant_alpha=0.5, calibration=CALIBRATION)}
    folders = {}
    for name in names:
        if name == "plain":
            folders[name] = plain
            continue
        folders[name] = os.path.join(work, name)
        if not os.path.isfile(os.path.join(folders[name], "model.safetensors")):
            quantize_checkpoint(source, folders[name], **options[name])
    return source, folders


def embedding_noise(num_tokens: int, hidden_size: int, eps: float, seed: int) -> torch.Tensor:
    """The factor each embedding value is multiplied by: 1 + eps * N(0, 1), one per token row and channel."""
    generator = torch.Generator().manual_seed(seed)
    return 1 + eps * torch.randn(num_tokens, hidden_size, generator=generator)


def perplexity_of_logprobs(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def engine_perplexity(llm: LLM, token_ids: list[int], noise: torch.Tensor | None) -> float:
    """The engine's perplexity (prompt logprobs) with the embedding output of each prompt row multiplied by its row
    of `noise` (a forward hook that follows the rows across prefill chunks)."""
    embed = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.embed_tokens
    handle = None
    if noise is not None:
        consumed = [0]  # rows of the prompt already embedded (the prefill may come in chunks)

        def perturb(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            start, consumed[0] = consumed[0], consumed[0] + output.shape[0]
            return output * noise[start:consumed[0]].to(output.dtype)

        handle = embed.register_forward_hook(perturb)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        output = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    finally:
        if handle is not None:
            handle.remove()
    if noise is not None:
        assert consumed[0] == len(token_ids), (consumed[0], len(token_ids))  # every prompt row perturbed once
    scores = output.prompt_logprobs
    return perplexity_of_logprobs([scores[p][t].logprob for p, t in enumerate(token_ids) if p > 0])


@torch.no_grad()
def reference_perplexity(model: torch.nn.Module, token_ids: list[int], noise: torch.Tensor | None) -> float:
    """The HF model's perplexity on `token_ids`, its embeddings multiplied by `noise` when given."""
    ids = torch.tensor([token_ids])
    embeddings = model.model.embed_tokens(ids)
    if noise is not None:
        embeddings = embeddings * noise.unsqueeze(0)
    logits = model(inputs_embeds=embeddings).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor(token_ids[1:])
    return perplexity_of_logprobs(logprobs[:-1].gather(-1, targets[:, None])[:, 0].tolist())


def spread(measure: Callable[[torch.Tensor | None], float], num_tokens: int, hidden_size: int, eps: float,
           seeds: int) -> dict[str, object]:
    unperturbed = measure(None)
    perturbed = [measure(embedding_noise(num_tokens, hidden_size, eps, seed)) for seed in range(seeds)]
    values = [unperturbed] + perturbed
    return {"unperturbed": unperturbed, "perturbed": perturbed, "min": min(values),
            "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="400", help="tokens of the passage scored (a number, or 'all')")
    parser.add_argument("--seeds", type=int, default=4, help="perturbed runs per model and implementation")
    parser.add_argument("--eps", type=float, default=1e-7, help="relative size of the embedding perturbation")
    parser.add_argument("--checkpoints", nargs="+", default=["plain", "ignore", "smoothquant"],
                        choices=["plain", "ignore", "smoothquant"])
    parser.add_argument("--work", default=None, help="folder for the checkpoints written here (default: new /tmp)")
    parser.add_argument("--json-out", default=None)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    # The engine's perplexities depend on its kernels' arithmetic: record which ran, and stop if none did.
    native_kernels = native_guard.require_native_kernels(args.allow_plain_pytorch)
    from transformers import AutoModelForCausalLM
    from w8a8_reference import dequantized_hf_model

    work = args.work or tempfile.mkdtemp(prefix="pagedserve-w8a8-spread-")
    source, folders = checkpoint_folders(args.checkpoints, work)
    max_tokens = None if args.tokens == "all" else int(args.tokens)
    results: dict[str, object] = {"native_kernels": native_kernels, "tokens": args.tokens, "seeds": args.seeds,
                                  "eps": args.eps, "models": {}}
    for name, folder in [("float", source)] + list(folders.items()):
        started = time.perf_counter()
        llm = LLM(folder, **ENGINE)
        token_ids = llm.get_tokenizer()(passage_text(), add_special_tokens=False)["input_ids"][:max_tokens]
        hidden_size = llm.llm_engine.engine_core.executor.worker.model_runner.model.model.embed_tokens.weight.shape[1]
        engine = spread(partial(engine_perplexity, llm, token_ids), len(token_ids), hidden_size,
                        args.eps, args.seeds)
        del llm
        reference_model = (AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32)
                           .eval() if name == "float" else dequantized_hf_model(source, folder))
        reference = spread(partial(reference_perplexity, reference_model, token_ids), len(token_ids),
                           hidden_size, args.eps, args.seeds)
        del reference_model
        results["models"][name] = {"engine": engine, "reference": reference}
        print(f"{name:12s} ({len(token_ids)} tokens, {time.perf_counter() - started:.0f} s)", flush=True)
        for side, numbers in (("engine", engine), ("reference", reference)):
            perturbed = ", ".join(f"{value:.3f}" for value in numbers["perturbed"])
            print(f"  {side:9s} unperturbed {numbers['unperturbed']:.3f}  perturbed {perturbed}  "
                  f"(min {numbers['min']:.3f}, median {numbers['median']:.3f}, max {numbers['max']:.3f})", flush=True)
    float_engine = results["models"]["float"]["engine"]["unperturbed"]
    print(f"relative to the float model's {float_engine:.3f} (engine, unperturbed):")
    for name, sides in results["models"].items():
        row = "  ".join(f"{side} {100 * (sides[side]['min'] / float_engine - 1):+.1f}% .. "
                        f"{100 * (sides[side]['median'] / float_engine - 1):+.1f}% .. "
                        f"{100 * (sides[side]['max'] / float_engine - 1):+.1f}%" for side in ("engine", "reference"))
        print(f"  {name:12s} {row}")
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
