"""The preflight on a host (the doctor, an on-host entry): packages, devices, ports and the link probe."""
