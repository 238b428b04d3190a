"""Serving: generation from trained weights, with a KV cache of what the model has already read
(``bd3lm``: the block diffusion model's sampler)."""
