"""Code only the benchmarks use: runtime rows and their profile fit, static-setting searches,
torchrun launching, the results tree's paths."""
