"""``python -m epd_engine`` is ``epdctl``."""

import sys

from epd_engine.cli import main

sys.exit(main())
