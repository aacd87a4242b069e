import sys

from ps_server.ops.cli import main

sys.exit(main())
