"""elastic-mnist: a torchrun-native, elastic, data-parallel MNIST training job."""

__version__ = "0.1.0"
