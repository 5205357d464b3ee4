"""The handle of a save that is running or done (``async_save`` returns one; a save
committed at once gets a completed one)."""

from __future__ import annotations

from concurrent.futures import Future

from ckrun.checkpoint.manifest import Manifest

__all__ = ["SaveHandle"]


class SaveHandle:
    """A save that is running or done; ``result()`` returns its committed Manifest.

    ``save`` returns manifests directly; ``async_save`` returns handles backed by a
    background persist (:class:`ckrun.checkpoint.async_save.AsyncSaveHandle`).
    """

    def __init__(self, future: Future[Manifest]):
        self._future = future

    @classmethod
    def completed(cls, manifest: Manifest) -> SaveHandle:
        """A handle for a save that already committed."""
        f: Future[Manifest] = Future()
        f.set_result(manifest)
        return cls(f)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait (at most ``timeout`` seconds) and return the manifest; re-raises errors."""
        return self._future.result(timeout)
