"""The host memory tier: activations, K/V and optimizer states held in host memory between uses."""
