"""`python -m minipaged.chat`: see `app.py`."""

import sys

from .app import main

sys.exit(main())
