import sys

from phalanx.cli import main

sys.exit(main())
