"""bfloat16 flash attention for encoder runs on avx512_bf16 CPUs (a C++ op built
at first use; importing this package builds nothing)."""
