"""Shipped HF ``config.json`` files (data only); see ``infinipipe_hf.models.model_configs``."""
