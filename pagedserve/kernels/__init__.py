"""The kernel layer: native CPU kernels (cpu/, C++), the ISA levels they are built for (cpu_isa.py), the module that
builds, loads and dispatches them (cpu_library.py), and the thin Python wrappers that only call a kernel."""
