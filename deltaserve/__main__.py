"""python -m deltaserve == the deltaserve command."""

import sys

from deltaserve.cli import main

sys.exit(main())
