"""``python -m elastic_mnist``: the program torchrun starts on every worker."""

import sys

from elastic_mnist.cli import main

code = main()
if "elastic_mnist.distributed" in sys.modules:  # it may have run a process group
    from elastic_mnist.distributed import end_process

    end_process(code)
sys.exit(code)
