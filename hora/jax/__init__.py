"""hora for jax (being built; see the issue)."""
