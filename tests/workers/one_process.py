"""Comparisons with a one-process reference, shared by the pattern workers (each a script of its own). ``count``:
the checks done, which a worker's OK line reports and its test asserts."""

import numpy as np


class Checks:
    """``hvd`` (PyTorch workers): the aiacc module whose ranks split a global batch of ``rows`` rows; ``rank``:
    this rank, for the messages of :meth:`equal` (the torch.distributed workers)."""

    def __init__(self, hvd=None, rows: int = 0, rank: int = 0):
        self.hvd, self.rows, self.rank, self.count = hvd, rows, rank, 0

    def shard(self, dist: bool) -> slice:
        """This rank's rows of the global batch (all of them for the one-process reference)."""
        r, n = self.hvd.rank(), self.hvd.size()
        return slice(r * self.rows // n, (r + 1) * self.rows // n) if dist else slice(0, self.rows)

    def same(self, what: str, got, want, tol: float = 1e-12) -> None:
        """Tensors ``got`` within ``tol`` of the reference ``want``, and bit-equal on every rank."""
        import torch  # noqa: PLC0415 - the TensorFlow workers use close()

        r = self.hvd.rank()
        worst = max(float((a - b).abs().max()) for a, b in zip(got, want))
        assert worst <= tol, f"rank {r}: {what}: {worst:.3g} from the one-process reference"
        everyone = self.hvd.allgather_object(got)
        assert all(torch.equal(a, b) for theirs in everyone for a, b in zip(theirs, everyone[0])), \
            f"{what}: ranks differ"
        self.count += 1

    def close(self, name: str, ref, got) -> None:
        """Variables or arrays ``got`` equal to ``ref`` to float32 rounding (TensorFlow / Keras workers)."""
        for v, w in zip(ref, got):
            a, b = np.asarray(v), np.asarray(w)
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6), \
                f"{name}: {getattr(v, 'path', '')} differs by {np.max(np.abs(a - b))}"
        self.count += 1

    def equal(self, name: str, got, want, tol: float = 0.0) -> None:
        """Tensor ``got`` of ``want``'s dtype and shape, equal to it (within ``tol``, compared in float64)."""
        import torch  # noqa: PLC0415 - the TensorFlow workers use close()

        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{name}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        ok = torch.equal(got, want) if tol == 0 else torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
        assert ok, f"{name} on rank {self.rank}: {got.flatten()[:8]} != {want.flatten()[:8]}"
        self.count += 1
