import os

# Two CPU cores on CI: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")

from flows import float64  # noqa: E402,F401  (after the thread count: torch reads it when imported)
