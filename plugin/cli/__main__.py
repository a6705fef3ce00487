"""`python -m expert_stream.plugin.cli` runs the `expert-stream` command."""

import sys

from expert_stream.plugin.cli import main

sys.exit(main())
