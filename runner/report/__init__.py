"""Read-only accounting of a run, for ``ckrun status``, ``ckrun runs`` and the timeline page.

Layered above :mod:`ckrun.supervisor` (it reads the run directory and the event log the
supervisor and the training process write) and below :mod:`ckrun.cli`:

* :mod:`.history`: the attempts of a run, parsed from ``events.jsonl``;
* :mod:`.goodput`: where the wall time went (start-up, restore, training kept, saving,
  lost work, shutdown, waiting) and the goodput;
* :mod:`.summary`: the ``ckrun status`` record of a run directory (numbers only);
* :mod:`.terminal` and :mod:`.timeline_html`: the two renderings.
"""
