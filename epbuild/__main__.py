"""``python -m epbuild``."""

import gc
import sys

gc.disable()  # importing the command line, which stays (frozen: no collection scans it)
from epbuild.frontends.cli import console  # noqa: E402

gc.freeze()
gc.enable()
sys.exit(console())
