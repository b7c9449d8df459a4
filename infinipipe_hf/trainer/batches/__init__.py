"""Token datasets, document pieces, the token-budget sampler and the global batch loader."""
