import sys

from ps_local.cli import main

sys.exit(main())
