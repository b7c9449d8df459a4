"""Models: shipped real-size configs (``model_configs``) and the offline SmolLM2 loader (``smollm2``)."""
