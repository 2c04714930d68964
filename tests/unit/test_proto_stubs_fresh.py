"""The committed stubs in shared/proto_gen are exactly what proto/*.proto generates now."""

from __future__ import annotations

from pathlib import Path

from shared.proto_gen import generate


def test_committed_stubs_match_the_protos(tmp_path: Path):
    fresh = generate.generate(out_dir=tmp_path)
    committed = generate.generated_files(generate.HERE)
    assert [p.name for p in committed] == [p.name for p in fresh], (
        "stub files differ from proto/*.proto; run `python -m shared.proto_gen.generate`"
    )
    stale = [p.name for p in fresh if p.read_text() != (generate.HERE / p.name).read_text()]
    assert not stale, f"stale stubs {stale}; run `python -m shared.proto_gen.generate`"


def test_stubs_import_as_a_package():
    from shared.proto_gen import kvtransfer_pb2, kvtransfer_pb2_grpc

    assert (
        "shared.proto_gen import kvtransfer_pb2" in Path(kvtransfer_pb2_grpc.__file__).read_text()
    )
    assert kvtransfer_pb2.KVLayout(num_layers=3).num_layers == 3
