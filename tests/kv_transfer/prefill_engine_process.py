"""A prefill (producer) engine in its own process, driven by JSON lines on stdin (tests only).

    python prefill_engine_process.py MODEL_DIR 'ENGINE_KWARGS_JSON'
Commands (one JSON object a line), each answered by one JSON line on stdout:
    {"op": "prefill", "prompts": [[ids...], ...]} -> {"outputs": [{"token_ids": [...], "kv_transfer_params": {...}}]}
    {"op": "blocks"} -> {"num_free_blocks": n, "num_blocks": m, "num_held": h} (every DP rank's together: with
        every block free, num_free_blocks == num_blocks - 1)
    {"op": "submit", "requests": [{"request_id": id, "prompt": [ids...]}, ...]} -> {"submitted": n}: added with
        do_remote_decode and left running (push mode: the consumer names these ids), the loop steps them
    {"op": "push_stats"} -> the push mode's counters: {"num_layer_sends", "num_catch_up_sends", "num_waiting_orders"}
    {"op": "abort", "request_id": id} -> {"aborted": id}: aborted before the loop's next step (a submitted request
        not yet scheduled stays unscheduled when both commands come in one line: use "submit" with "abort": true)
    {"op": "finished_at", "request_id": id} -> {"finished_at": wall time (time.time()) its output finished, or null}
    {"op": "quit"}
Between commands the engine keeps stepping while it holds blocks for consumers, so their done notices and the
free timeout release them.
"""
from __future__ import annotations

import json
import select
import sys
import time


def main() -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.engine.engine_core_proc import _kv_transfer_ranks

    model_dir, engine_kwargs = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model_dir, **engine_kwargs)
    engine = llm.llm_engine
    core = engine.engine_core
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    # One engine core per DP rank (data_parallel_size > 1: DataParallelEngineCore); the answers below sum them.
    cores = list(getattr(core, "cores", None) or [core])
    print(json.dumps({"ready": True, "port": core.runtime_info.kv_transfer_port,
                      "data_parallel_ranks": _kv_transfer_ranks(core)}), flush=True)
    # Request id -> wall time its prefill finished (benchmarks compare it with the consumer's first token).
    finished_at: dict[str, float] = {}
    while True:
        # Requests running (submitted ones): a step between each look at stdin, without waiting.
        readable, _, _ = select.select([sys.stdin], [], [], 0 if engine.has_unfinished_requests() else 0.02)
        if not readable:
            if engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished_at[output.request_id] = time.time()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        command = json.loads(line)
        if command["op"] == "quit":
            break
        if command["op"] == "prefill":
            outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in command["prompts"]], params,
                                   use_tqdm=False)
            finished_at.update((output.request_id, time.time()) for output in outputs)
            answer = {"outputs": [{"token_ids": output.outputs[0].token_ids, "request_id": output.request_id,
                                   "kv_transfer_params": output.kv_transfer_params} for output in outputs]}
        elif command["op"] == "submit":
            for item in command["requests"]:
                engine.add_request(item["request_id"], {"prompt_token_ids": item["prompt"]}, params)
            if command.get("abort"):  # before any step: the requests end without computing anything
                engine.abort_request([item["request_id"] for item in command["requests"]])
            answer = {"submitted": len(command["requests"])}
        elif command["op"] == "abort":
            engine.abort_request([command["request_id"]])
            answer = {"aborted": command["request_id"]}
        elif command["op"] == "finished_at":
            answer = {"finished_at": finished_at.get(command["request_id"])}
        elif command["op"] == "push_stats":
            connectors = [rank_core.executor.worker.kv_connector for rank_core in cores]
            num_waiting = 0
            for connector in connectors:
                with connector._lock:
                    num_waiting += sum(len(orders) for orders in connector._waiting_orders.values())
            answer = {"num_layer_sends": sum(connector.num_layer_sends for connector in connectors),
                      "num_catch_up_sends": sum(connector.num_catch_up_sends for connector in connectors),
                      "num_waiting_orders": num_waiting,
                      "num_layer_sends_per_rank": [connector.num_layer_sends for connector in connectors]}
        elif command["op"] == "blocks":
            deadline = time.monotonic() + float(command.get("wait_s", 0))
            while any(rank_core.scheduler.has_kv_held_requests() for rank_core in cores) \
                    and time.monotonic() < deadline:
                engine.step()
                time.sleep(0.01)
            # Every rank's blocks together (each rank keeps one block out of use).
            answer = {"num_free_blocks": sum(rank_core.kv_cache_manager.num_free_blocks for rank_core in cores),
                      "num_blocks": sum(rank_core.runtime_info.num_kv_blocks - 1 for rank_core in cores) + 1,
                      "num_held": sum(len(rank_core.scheduler.kv_held_requests) for rank_core in cores)}
        else:
            answer = {"error": f"unknown op {command['op']!r}"}
        print(json.dumps(answer), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
