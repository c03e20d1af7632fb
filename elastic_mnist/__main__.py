import sys

from elastic_mnist.cli import main

sys.exit(main())
