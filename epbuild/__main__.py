"""``python -m epbuild``."""

import gc
import sys

gc.disable()  # importing the command line; main() then runs each command with or without it
from epbuild.frontends.cli import console  # noqa: E402

gc.enable()
sys.exit(console())
