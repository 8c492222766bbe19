"""The replacement forwards swapped into HF modules, and the plans (weights, kernels) they read."""
