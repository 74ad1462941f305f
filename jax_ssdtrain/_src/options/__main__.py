"""``python -m jax_ssdtrain._src.options [--write PAGE | --check PAGE]``: the options table."""

import sys

from jax_ssdtrain._src.options import main

sys.exit(main())
