"""``python -m elastic_mnist``: the program torchrun starts on every worker."""

from elastic_mnist.cli import main

code = main()
from elastic_mnist.distributed import end_process  # after main: --help stays quick

end_process(code)
