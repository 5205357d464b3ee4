"""Data package: k8s templates shipped inside the ckrun wheel."""
