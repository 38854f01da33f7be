"""`python -m lingjax.train --out RUN_DIR ...`: start or resume a training run (lingjax.train.run)."""

import sys

from lingjax.train.run import main

sys.exit(main())
