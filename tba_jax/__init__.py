"""tba_jax: Trajectory Balance with Asynchrony (TBA) for LLM post-training in JAX/Flax."""

__version__ = "0.1.0"
