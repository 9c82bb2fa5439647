"""The run on the control machine: the agent (state machine), its record, failures, output, tables."""
