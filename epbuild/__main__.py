"""``python -m epbuild``."""

import sys

from epbuild.frontends.cli import main

sys.exit(main())
