"""Process-wide test set-up that must happen before anything imports triton."""
import os

import torch

if not torch.cuda.is_available():
    # NOTE: Triton reads this when it is first imported; kernels then run in its CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
