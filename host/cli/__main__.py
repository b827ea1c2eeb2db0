"""``python -m host.cli``: the `poet` command."""

import sys

from host.cli.main import main

sys.exit(main())
