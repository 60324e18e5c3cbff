"""Triton kernels for the CUDA path: paged attention over a whole mixed batch, KV writes.

They read and write the paged KV pool in place (engine.kv_cache's layout). On CPU they run only
under Triton's interpreter (TRITON_INTERPRET=1, set before this package is imported), which is how
CI tests them; the CPU engine itself never imports them.
"""
