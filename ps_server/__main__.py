import sys

from ps_server.cli import main

sys.exit(main())
