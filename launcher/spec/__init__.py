"""The cluster spec: its model (cluster, with the parts every table shares in base and the scheduler tables in slurm and kubernetes) and the reading of cluster.toml (file)."""
