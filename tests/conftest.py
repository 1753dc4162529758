import os

# Two CPU cores on CI: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "2")
