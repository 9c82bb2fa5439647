"""The preflight's verdicts from what each host reported: devices and network interfaces, and the links between the hosts."""
