"""Test-session settings shared by every test file.

The suite runs with two pytest-xdist workers on two cores; torch's default of one intra-op thread per
core would make each worker spin against the other, so every worker uses a single thread.
"""

import torch

torch.set_num_threads(1)
