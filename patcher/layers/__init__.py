"""The replacement forwards swapped into HF modules, the plans (weights, kernels) they read (plans.py), and the
guard that picks the fused forward or HF's own for each call (guard.py)."""
