"""Runs the Storage contract (contract.py) against every backend in conftest.BACKENDS."""

from contract import *  # noqa: F403
