"""The engine side of test_ray_multi_node.py, run as its own process: `python ray_cluster_driver.py '<json>'`.

It joins the Ray cluster named by RAY_ADDRESS the way a user's process does (the 'ray' executor connects
through RAY_ADDRESS), runs TP=2 over it, and prints one line `RESULT <json>`: each rank's node id, the
tokens generated, and whether the process is still in a Ray session after the engine shut down.

A process of its own because Ray's authentication mode is fixed per process when Ray first reads it: a test
process that already ran a local cluster (token authentication) could not talk to this cluster, nor the
reverse, whatever the environment says later.
"""
from __future__ import annotations

import json
import os
import sys
import time

RESULT_PREFIX = "RESULT "
# The second node may still be registering when the cluster answers.
CLUSTER_WAIT_S = 120.0


def _wait_for_cpus(address: str, num_cpus: int) -> None:
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + CLUSTER_WAIT_S
        while ray.cluster_resources().get("CPU", 0) < num_cpus or sum(node["Alive"] for node in ray.nodes()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not show two nodes with {num_cpus} CPUs: {ray.nodes()}")
            time.sleep(0.2)
    finally:
        ray.shutdown()


def run_tp2_on_the_cluster(folder: str, prompts: list[list[int]], max_tokens: int,
                           engine_kwargs: dict) -> dict:
    import ray

    from pagedserve import LLM, SamplingParams

    _wait_for_cpus(os.environ["RAY_ADDRESS"], 2)
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="ray", **engine_kwargs)
    try:
        executor = llm.llm_engine.engine_core.executor
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False)
        result = {"executor": type(executor).__name__, "node_ids": list(executor.node_ids),
                  "gcs_address": ray.get_runtime_context().gcs_address,
                  "tokens": [list(output.outputs[0].token_ids) for output in outputs]}
    finally:
        llm.llm_engine.shutdown()
    result["ray_initialized_after_shutdown"] = ray.is_initialized()
    return result


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(run_tp2_on_the_cluster(**json.loads(sys.argv[1]))), flush=True)
