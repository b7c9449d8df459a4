"""The runtime measured on CPU (gloo): exactness, memory, the simulator against real runs."""
