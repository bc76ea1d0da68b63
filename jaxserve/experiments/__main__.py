import sys

from jaxserve.experiments.cli import main

sys.exit(main())
