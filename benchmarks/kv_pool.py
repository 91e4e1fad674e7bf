"""KV pool (PoolConnector): TTFT of a repeated 2k-token prefix on a fresh second engine with the pool on vs off, and
the store's put / get bandwidth, for each backend.

    PYTHONPATH=. python benchmarks/kv_pool.py [--backends redis mooncake] [--prefix-len 2048] [--repeats 3]

Per backend a store server is started on a free port of 127.0.0.1 (redis-server / mooncake_master) and stopped at
the end. Engine A computes prefix_i + suffix A (max_tokens=1) and stores its blocks; engine B, started after A (its
own cache empty of every prefix_i), serves prefix_i + suffix B: its TTFT (the wall time of a max_tokens=1 request on
an idle engine) is "pool on". Engine C, without a connector, serves the same prompt: "pool off". B also serves a
prompt that the pool has never seen ("pool on, miss": the lookup and the stores cost). Each repeat uses a new
prefix; medians are shown. "Block load" is the worker's time for a hit's load order (one batched get, the header and
checksum checks, the copy into the cache). Bandwidth: batches of block-sized values (one block of every layer, with its header) written and read through
the store client alone, best of --repeats. The model is a random Llama (4 layers, 8 KV heads of 64, float32: 16 KiB of
KV per token, 256 KiB per 16-token block), as in kv_transfer.py.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "kv_transfer"))
sys.path.insert(0, ROOT)

from pagedserve import LLM, SamplingParams  # noqa: E402
import native_guard  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - start


def bandwidth(backend: str, url: str, block_bytes: int, num_blocks: int, repeats: int) -> tuple[float, float]:
    """Best put and get GB/s of `num_blocks` values of one block each, in one batch, through the store client."""
    from pagedserve.config.kv_pool import KVPoolConfig
    from pagedserve.kv_transfer.pool_block_format import encode_block
    from pagedserve.kv_transfer.pool_store import connect_pool_store

    store = connect_pool_store(KVPoolConfig(backend=backend, url=url, mooncake_segment_bytes=1024 * 2**20), 30.0,
                               lends_memory=True)
    payload = os.urandom(block_bytes)
    best_put = best_get = float("inf")
    try:
        for repeat in range(repeats):
            items = [(f"bench/{repeat}/{index}", encode_block(index, payload)) for index in range(num_blocks)]
            start = time.perf_counter()
            store.put(items)
            best_put = min(best_put, time.perf_counter() - start)
            start = time.perf_counter()
            values = store.get([key for key, _ in items])
            best_get = min(best_get, time.perf_counter() - start)
            assert all(value is not None and len(value) == len(items[0][1]) for value in values)
    finally:
        store.close()
    total = num_blocks * (block_bytes + 32)
    return total / best_put / 1e9, total / best_get / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["redis", "mooncake"])
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    native_guard.add_allow_plain_pytorch_argument(parser)
    args = parser.parse_args()
    native_guard.require_native_kernels(args.allow_plain_pytorch)
    from pool_store_servers import StoreServer
    from tiny_models import build_tiny_model

    max_len = args.prefix_len + args.suffix_len + 64
    model = build_tiny_model("llama", tempfile.mkdtemp(prefix="pagedserve-pool-bench-"), hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8,
                             num_hidden_layers=4, max_position_embeddings=max_len)
    engine_kwargs = dict(max_model_len=max_len, num_kv_blocks=4 * (max_len // 16 + 2), block_size=16,
                         native_decode_stack=False, num_cpu_threads=1)
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(8, 400) for _ in range(count)]

    engine_off = LLM(model, **engine_kwargs)
    ttft(engine_off, tokens(64))  # warm-up
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| backend | prefix tokens | TTFT pool off ms | TTFT pool on (hit) ms | of which block load ms | "
          "TTFT pool on (miss) ms | off / hit | put GB/s | get GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in args.backends:
        server = StoreServer(backend).start()
        kv_transfer_config = {"kv_connector": "PoolConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"backend": backend, "url": server.url,
                                                            "mooncake_segment_bytes": 1024 * 2**20}}
        engine_a = LLM(model, kv_transfer_config=kv_transfer_config, **engine_kwargs)
        engine_b = None
        try:
            prefixes = [tokens(args.prefix_len) for _ in range(args.repeats)]
            for prefix in prefixes:
                ttft(engine_a, prefix + tokens(args.suffix_len))
            writer = engine_a.llm_engine.engine_core.executor.worker.kv_connector
            assert writer.wait_for_stores(120), "engine A's blocks were not all stored"
            engine_b = LLM(model, kv_transfer_config=kv_transfer_config, **engine_kwargs)
            ttft(engine_b, tokens(64))  # warm-up (also a miss)
            reader = engine_b.llm_engine.engine_core.executor.worker.kv_connector
            hit, off, miss, load = [], [], [], []
            for prefix in prefixes:
                suffix = tokens(args.suffix_len)
                off.append(ttft(engine_off, prefix + suffix))
                load_seconds = reader.load_seconds
                hit.append(ttft(engine_b, prefix + suffix))
                load.append(reader.load_seconds - load_seconds)
                miss.append(ttft(engine_b, tokens(args.prefix_len + args.suffix_len)))
                # The miss's blocks are written in the background: not into the next figure.
                assert reader.wait_for_stores(120)
            assert reader.num_loaded_blocks == args.repeats * (args.prefix_len // 16), reader.num_loaded_blocks
            put, get = bandwidth(backend, server.url, writer.block_bytes, args.prefix_len // 16, args.repeats)
            print(f"| {backend} | {args.prefix_len} | {statistics.median(off) * 1000:.0f} | "
                  f"{statistics.median(hit) * 1000:.0f} | {statistics.median(load) * 1000:.0f} | "
                  f"{statistics.median(miss) * 1000:.0f} | "
                  f"{statistics.median(off) / statistics.median(hit):.1f}x | {put:.2f} | {get:.2f} |", flush=True)
        finally:
            for engine in (engine_a, engine_b):
                if engine is not None:
                    engine.llm_engine.shutdown()
            server.stop()
    print(f"load average {os.getloadavg()[0]:.1f}")
    engine_off.llm_engine.shutdown()


if __name__ == "__main__":
    main()
