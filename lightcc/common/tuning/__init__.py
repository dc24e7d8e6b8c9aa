"""Tuning: the autotuner (autotune.py) that searches fusion threshold, cycle time and algorithm
during training, its search loop (search.py) and its on-disk cache of results (cache.py)."""
