"""Suite-wide settings.

``CKRUN_WRITER=direct`` pins :class:`ckrun.storage.local.LocalStorage`'s streaming
writer to the ``O_DIRECT`` double buffer (the default before issue 19's adaptive probe),
so the suite's results do not depend on what a probe measures on a busy disk; the
probe itself is tested in tests/storage/test_writer_probe.py, which clears it.
``CKRUN_CACHE_DIR`` keeps remembered probes out of the home directory.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("CKRUN_WRITER", "direct")
os.environ.setdefault("CKRUN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ckrun-test-cache"))
