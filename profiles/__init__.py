"""Data package: the YAML profiles shipped inside the ckrun wheel."""
