"""`mgpu-cluster dashboard`: a read-only web page of the runs and GET /metrics, served from the run records."""
