"""``python -m agentbox``: the client CLI (same as the ``agentbox`` command)."""

import sys

from agentbox.cli import main

sys.exit(main())
