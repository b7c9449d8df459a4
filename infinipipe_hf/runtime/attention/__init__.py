"""Attention of units over their segments: backends, KV store, the HF entry point."""
