import os
import sys

# Tests never reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(__file__))  # for `tiny`

import mlx_kvlingo  # noqa: E402,F401  (first: fast BLAS before mlx.core)
