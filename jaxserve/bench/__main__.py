import sys

from .offline import main

sys.exit(main())
