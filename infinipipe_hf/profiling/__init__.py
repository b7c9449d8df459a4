"""GPU profiler internals behind ``python -m infinipipe_hf.profile`` (see that module)."""
