"""jaxrl: pipeline RL for language models in JAX."""
