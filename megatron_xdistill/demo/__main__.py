"""``python -m megatron_xdistill.demo`` (``make demo``): see :mod:`.quickstart`."""

import sys

from megatron_xdistill.demo.quickstart import main

sys.exit(main())
