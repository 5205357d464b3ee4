"""Integrations with training frameworks (issue 15): optional extras, imported lazily.

* :mod:`ckrun.integrations.hf`: the Hugging Face Trainer (``pip install 'ckrun[hf]'``).
* :mod:`ckrun.integrations.lightning`: PyTorch Lightning (``pip install 'ckrun[lightning]'``).

Both commit the checkpoint the framework writes itself as a ckrun file set
(:mod:`ckrun.checkpoint.fileset`) and resume from the newest verified one.  Nothing here
is imported by ``import ckrun`` or by the supervisor.
"""
