"""One rank of a timed run, launched by torchrun as a module (``torchrun ... -m benchmarks.workers.X``)."""
