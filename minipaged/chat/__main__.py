"""`python -m minipaged.chat`: see `app.py`."""

from .app import main

raise SystemExit(main())
