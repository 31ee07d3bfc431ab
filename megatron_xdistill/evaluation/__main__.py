"""``python -m megatron_xdistill.evaluation`` (also ``xdistill-evaluate``): see
:mod:`.bits_per_byte`."""

import sys

from megatron_xdistill.evaluation.bits_per_byte import main

sys.exit(main())
