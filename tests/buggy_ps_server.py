"""A ps-server with a bug planted for tests: answering a pull of a variable named ``boom`` raises.

Run as ``python tests/buggy_ps_server.py <ps-server flags>``. What a
server does with an exception it did not expect is otherwise untestable
(every known failure is a RequestError with its own status).
"""

from __future__ import annotations

import sys

from ps_server.ops.cli import main
from ps_server.service import servicer

PLANTED = "planted bug: pulling 'boom'"

_pull_messages = servicer.pull_messages


def _buggy_pull_messages(plan):
    if any(read[0].spec.name == "boom" for read in plan.reads):
        raise RuntimeError(PLANTED)
    return _pull_messages(plan)


servicer.pull_messages = _buggy_pull_messages

if __name__ == "__main__":
    sys.exit(main())
