"""The systems HF users run for long context instead of a pipeline, priced by the same cost model."""
