import sys

from deepdsl.cli import main

sys.exit(main())
