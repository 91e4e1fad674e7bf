"""The test modules of the native CPU kernels: marked `native_kernels` (tests/conftest.py) and run once more at every
other ISA level the machine supports (tests/kernels/test_isa_levels.py, which collects only these modules there)."""
from __future__ import annotations

# Each kernel against its plain reference, and the decode stack against the modules; paths from the repository root.
NATIVE_KERNEL_TEST_MODULES: tuple[str, ...] = (
    "tests/attention/test_cpu_native.py", "tests/attention/test_native_kv_write.py",
    "tests/attention/test_prefill_attention.py", "tests/attention/test_native_int8_kv.py", "tests/layers/test_amx_gate_up_silu.py",
    "tests/layers/test_amx_linear.py", "tests/layers/test_native_elementwise.py",
    "tests/layers/test_small_batch_linear.py", "tests/models/test_native_decode_stack.py",
    "tests/sample/test_first_argmax.py", "tests/sample/test_fused_greedy_head.py",
    "tests/layers/test_gguf_linear.py", "tests/layers/test_gguf_interleaved.py",
    "tests/model_loader/test_gguf_decode_stack.py",
    "tests/quantization/test_w8a8_native_kernel.py", "tests/quantization/test_w8a8_decode_stack.py",
    "tests/attention/test_native_int8_prefill.py", "tests/models/test_native_decode_stack_int8_kv.py",
)
