"""The on-host task core: runs one task whatever started it (our supervisor, srun, a pod)."""
