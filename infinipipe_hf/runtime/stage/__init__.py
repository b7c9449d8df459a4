"""A pipeline stage: the HF layers it owns, unit tensors, loss, forward/backward."""
