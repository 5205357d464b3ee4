"""Fixtures for the Slurm tests (defined in ``slurm_helpers.py``).

Tests marked ``slurm`` need the single-node cluster of ``slurm/dev-cluster.sh`` (``.ci/run``
starts it).  They are skipped, with the reason, when ``sinfo`` is not installed or no
controller answers (the client installed without a cluster); with ``CKRUN_REQUIRE_SLURM=1``
(set by ``.ci/run``) a missing or stopped cluster fails them.
"""

from slurm_helpers import cancel_jobs, cluster

__all__ = ["cancel_jobs", "cluster"]
