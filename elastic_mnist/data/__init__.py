"""Digits in memory: IDX files, MNIST on disk, synthetic digits, and each epoch's sample order."""
