"""The evaluation tools, patched against unpatched in one process: tpot (decode speed), perplexity (accuracy), ops
(each fused op against the PyTorch sequence it replaces, GPU), splits (the int4 K slices against the split rule).

Run them as `python -m evals.tpot` from the repository root, or after `pip install` as the console scripts
patcher-tpot, patcher-perplexity and patcher-ops from any folder.
"""
