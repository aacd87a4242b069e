"""The committed stubs (wehub_ps/v1, ps_server/coordination/etcdpb) are what protoc makes of protos/."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_generated_code_matches_protos(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", *map(str, protos)]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    stub_directories = sorted({ROOT / p.relative_to(tmp_path).parent for p in tmp_path.rglob("*_pb2*.py*")})
    committed = sorted(p.relative_to(ROOT) for d in stub_directories for p in d.glob("*_pb2*.py*"))
    assert [str(p) for p in generated] == [str(p) for p in committed]
    for path in generated:
        assert (tmp_path / path).read_bytes() == (ROOT / path).read_bytes(), (
            f"{path} is stale: regenerate with `python -m grpc_tools.protoc -Iprotos --python_out=. "
            "--pyi_out=. --grpc_python_out=. $(find protos -name '*.proto')`")
