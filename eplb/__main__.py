import sys

from eplb.cli import main

sys.exit(main())
