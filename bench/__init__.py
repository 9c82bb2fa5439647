"""mgpu-cluster's benchmarks, each against a baseline measured in the same run: `python -m bench`
(or `python bench/run.py`); one module per benchmark, shared helpers in timing, common, results."""
