"""Attention kernels: the learner's full-sequence (training) attention per backend."""
