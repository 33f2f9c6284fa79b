"""``python -m slipstream`` (and ``torchrun -m slipstream``) runs the CLI."""

import sys

from .cli import main

sys.exit(main())
