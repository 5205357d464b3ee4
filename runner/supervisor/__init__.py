"""The supervisor: the pure state machine, its loop, preflight, process tree, run directory."""
