"""Saving and loading stage weights, adapters and optimizer states."""
