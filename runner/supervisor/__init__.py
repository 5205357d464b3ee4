"""The supervisor: the pure state machine, its loop, preflight, the process tree, the run directory."""
