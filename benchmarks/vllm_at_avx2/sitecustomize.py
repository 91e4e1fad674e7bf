"""vLLM CPU at the AVX2 level on a machine with AVX-512 or AMX, for side-by-side runs at pagedserve's avx2 cap.

vLLM CPU 0.32 loads its AVX2 kernel library (vllm._C_AVX2) and chooses its kernels from torch.cpu's probes; with this
folder first on PYTHONPATH every probe above AVX2 answers False in each of its processes, so it runs what it runs
on an AVX2-only CPU (with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 for torch and oneDNN):

    PYTHONPATH=benchmarks/vllm_at_avx2 PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/offline_vs_vllm.py --vllm-python DIR/bin/python --dtype float32 ...

In pagedserve's own process the same probes answer False too; pagedserve reads its level from PAGEDSERVE_CPU_ISA.
"""
import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported", "_is_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
