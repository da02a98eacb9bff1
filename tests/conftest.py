"""Shared test fixtures. Tests run single-threaded so the fast suite is stable on 2 cores."""

import torch

torch.set_num_threads(1)
