"""Why a run is stuck or slow: the tasks' stacks, a straggler, a picture of the run."""
