"""Data package: slurm templates shipped inside the ckrun wheel."""
