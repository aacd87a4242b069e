"""ps-admin's help (no servers)."""

from __future__ import annotations

import pytest

from wehub_ps.cluster import CLUSTER_ENVIRONMENT, CONNECTION_ENVIRONMENT, WORKER_ID_ENV
from worker_client.admin import ENVIRONMENT, main


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_variables_of_the_shared_tables(capsys):
    text = _help(capsys)
    names = {s.name for s in CLUSTER_ENVIRONMENT + CONNECTION_ENVIRONMENT} - {WORKER_ID_ENV}
    assert names == {s.name for s in ENVIRONMENT}
    for setting in ENVIRONMENT:
        line = next(line for line in text.splitlines() if line.split()[:1] == [setting.name])
        assert setting.meaning in line
    for name in ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_AUTH_TOKEN_FILE", "PS_ADDRESSES", "TF_CONFIG"):
        assert name in text
