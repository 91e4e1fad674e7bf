"""`pagedserve bench serve`: an asyncio load generator for OpenAI-compatible /v1/completions servers.

It streams every request (so it works against any engine with an OpenAI-style streaming endpoint:
pagedserve, vLLM, SGLang...) and measures, per request:
  - TTFT: time to the first streamed token;
  - ITL: gaps between successive streamed chunks;
  - TPOT: (E2E - TTFT) / (output tokens - 1);
  - E2E latency.
Arrivals are Poisson at --request-rate (exponential gaps from a seeded generator), optionally capped by
--max-concurrency; `inf` sends everything at once. Prompts are random token ids with lengths drawn from
--input-len-range, or lines of a file; max_tokens is drawn from --output-len-range (with ignore_eos so
the output lengths are what was asked for). Goodput counts the requests that met every given SLO.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None  # None for file prompts (the server's usage tells)
    max_tokens: int


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def make_requests(num_prompts: int, dataset: str, dataset_path: str | None, input_len_range: tuple[int, int],
                  output_len_range: tuple[int, int], vocab_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    """The benchmark's requests, identical for the same arguments and seed."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    for name, (low, high) in (("input_len_range", input_len_range), ("output_len_range", output_len_range)):
        if not 1 <= low <= high:
            raise ValueError(f"{name}=[{low}, {high}] must satisfy 1 <= MIN <= MAX")
    if not 0 <= vocab_range[0] < vocab_range[1]:
        raise ValueError(f"vocab_range=[{vocab_range[0]}, {vocab_range[1]}) must satisfy 0 <= LOW < HIGH")
    rng = np.random.default_rng(seed)
    output_lens = rng.integers(output_len_range[0], output_len_range[1] + 1, size=num_prompts)
    if dataset == "random":
        input_lens = rng.integers(input_len_range[0], input_len_range[1] + 1, size=num_prompts)
        return [BenchRequest(prompt=rng.integers(vocab_range[0], vocab_range[1], size=int(length)).tolist(),
                             prompt_len=int(length), max_tokens=int(out))
                for length, out in zip(input_lens, output_lens)]
    if dataset != "file":
        raise ValueError(f"dataset={dataset!r} must be 'random' or 'file'")
    if not dataset_path or not os.path.isfile(dataset_path):
        raise ValueError(f"dataset_path={dataset_path!r} must be an existing file for dataset='file'")
    prompts: list[str] = []
    with open(dataset_path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                prompts.append(str(json.loads(line)["prompt"]))
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"dataset_path={dataset_path!r} holds no prompts")
    order = rng.permutation(max(num_prompts, len(prompts)))
    return [BenchRequest(prompt=prompts[int(order[i]) % len(prompts)], prompt_len=None, max_tokens=int(out))
            for i, out in enumerate(output_lens)]


async def send_request(http: httpx.AsyncClient, url: str, headers: dict[str, str], model: str,
                       request: BenchRequest, temperature: float, ignore_eos: bool) -> RequestResult:
    body: dict[str, Any] = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(success=False, prompt_len=request.prompt_len or 0)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    usage_tokens: int | None = None
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = str(payload["error"])
                    return result
                usage = payload.get("usage")
                if usage:
                    usage_tokens = int(usage.get("completion_tokens", 0))
                    result.prompt_len = int(usage.get("prompt_tokens", result.prompt_len))
                choices = payload.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2el = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    result.success = num_chunks > 0
    if not result.success:
        result.error = "no tokens streamed"
    return result


def _percentiles(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    array = np.asarray(values, dtype=np.float64) * 1000.0  # milliseconds
    stats = {"mean": float(array.mean()), "std": float(array.std())}
    stats.update({f"p{p:g}": float(np.percentile(array, p)) for p in percentiles})
    return stats


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """'ttft:500' style SLOs in milliseconds -> {'ttft': 500.0}; metrics: ttft, tpot, e2el."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"goodput={spec!r} must be METRIC:MS with METRIC in ttft, tpot, e2el")
        slos[name] = float(value)
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft * 1000, "e2el": result.e2el * 1000,
                "tpot": (result.tpot or 0.0) * 1000}
    return result.success and all(measured[name] <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              slos: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.success]
    total_output = sum(r.output_tokens for r in done)
    total_input = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "ttft": _percentiles([r.ttft for r in done], percentiles),
        "tpot": _percentiles([r.tpot for r in done if r.tpot is not None], percentiles),
        "itl": _percentiles([gap for r in done for gap in r.itl], percentiles),
        "e2el": _percentiles([r.e2el for r in done], percentiles),
    }
    if slos:
        good = sum(1 for r in done if meets_slos(r, slos))
        summary["goodput_slos_ms"] = slos
        summary["goodput_requests_per_s"] = good / duration if duration > 0 else 0.0
    return summary


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], *, endpoint: str = "/v1/completions",
                        api_key: str | None = None, request_rate: float = float("inf"),
                        max_concurrency: int | None = None, seed: int = 0, temperature: float = 0.0,
                        ignore_eos: bool = True, timeout: float = 600.0,
                        warmup_requests: int = 0) -> tuple[list[RequestResult], float]:
    """Send `requests` with Poisson arrivals; returns the per-request results and the wall time."""
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf: all at once)")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    url = base_url.rstrip("/") + endpoint
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = np.random.default_rng(seed + 1)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        for request in requests[:warmup_requests]:
            await send_request(http, url, headers, model, request, temperature, ignore_eos)

        async def limited(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send_request(http, url, headers, model, request, temperature, ignore_eos)
            async with semaphore:
                return await send_request(http, url, headers, model, request, temperature, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for index, request in enumerate(requests):
            tasks.append(asyncio.create_task(limited(request)))
            if request_rate != float("inf") and index < len(requests) - 1:
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'completed / failed':<28} {summary['completed']} / {summary['failed']}",
             f"{'duration (s)':<28} {summary['duration_s']:.2f}",
             f"{'request throughput (req/s)':<28} {summary['request_throughput']:.2f}",
             f"{'output throughput (tok/s)':<28} {summary['output_throughput']:.1f}",
             f"{'total throughput (tok/s)':<28} {summary['total_token_throughput']:.1f}"]
    if "goodput_requests_per_s" in summary:
        lines.append(f"{'goodput (req/s)':<28} {summary['goodput_requests_per_s']:.2f}")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = summary[metric]
        lines.append(f"{metric + ' (ms)':<28} " + "  ".join(f"{key}={value:.2f}" for key, value in stats.items()))
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `pagedserve bench serve` handler: run, print a table, write JSON; 1 when any request failed."""
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    slos = parse_goodput(args.goodput)
    requests = make_requests(args.num_prompts, args.dataset, args.dataset_path, tuple(args.input_len_range),
                             tuple(args.output_len_range), tuple(args.vocab_range), args.seed)
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    results, duration = asyncio.run(run_benchmark(
        args.base_url, args.model, requests, endpoint=args.endpoint, api_key=api_key,
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos, timeout=args.timeout,
        warmup_requests=args.warmup_requests))
    summary = summarize(results, duration, percentiles, slos)
    summary["config"] = {key: value for key, value in vars(args).items() if key not in ("handler", "api_key")}
    summary["per_request"] = [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results]
    print(format_summary(summary), file=sys.stdout)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1
