"""What the built-in runner does on either backend: the user's Task contract (entrypoint), progress, the checkpoint folder's rules, the group's size checks, and the lines a task says."""
