"""The run page's downloads (the API app, PostgreSQL, Redis as broker; no worker, so an
export stays in the making until the test writes it as a worker would): the three formats
offered, ``?format=onnx`` answered with the ONNX file (it was the safetensors file, the
format ignored), and an export's page following it while it is made, once made and once
failed."""

from __future__ import annotations

import hashlib
import re
import uuid

from tests.service.test_dashboard import sign_in
from tests.service.test_downloads import _finished_job


def test_the_run_page_offers_each_format_and_follows_an_export(service_app, make_key, tmp_path):
    from zoopick.service import exports, pipeline
    from zoopick.service.db.session import session_scope

    tenant = make_key(f"fmt-{uuid.uuid4().hex[:6]}")
    folder = tmp_path / "run"
    job = _finished_job(service_app, tenant.token, folder, b"weights" * 100)
    b = sign_in(service_app, tenant.token)
    page = b.get(f"/jobs/{job}").text
    links = re.findall(rf'href="/jobs/{job}/model\?format=(\w+)"', page)
    assert links == ["safetensors", "timm", "onnx"]
    assert "ONNX Runtime" in page and "timm loads" in page
    assert b.get(f"/jobs/{job}/model?format=safetensors").content == b"weights" * 100
    bogus = b.get(f"/jobs/{job}/model?format=pt")
    assert bogus.status_code == 400 and "one of: safetensors, timm, onnx" in bogus.text

    # ONNX not made yet: its page, which says it is being made and for how long
    asked = b.get(f"/jobs/{job}/model?format=onnx")
    assert asked.status_code == 303, asked.text
    where = asked.headers["location"]
    assert re.fullmatch(rf"/jobs/{job}/export/onnx\?since=\d+", where), where
    making = b.get(where).text
    assert 'data-state="being-made"' in making and "so far" in making
    assert f'data-live-url="/jobs/{job}/export/onnx/live?since=' in making
    # made (as a worker records it): the fragment offers it and the link sends the ONNX file
    onnx = folder / "export" / "model.onnx"
    onnx.parent.mkdir(parents=True, exist_ok=True)
    onnx.write_bytes(b"onnx-bytes")
    with session_scope(service_app.state.sessionmaker) as session:
        digest = hashlib.sha256(b"onnx-bytes").hexdigest()
        pipeline.add_artefact(session, uuid.UUID(job), "model-onnx", str(onnx), digest, 10)
    live = b.get(f"/jobs/{job}/export/onnx/live").text
    assert 'data-state="ready"' in live and 'data-done="true"' in live and "(10 bytes)" in live
    got = b.get(f"/jobs/{job}/model?format=onnx")
    assert got.status_code == 200 and got.content == b"onnx-bytes"
    assert got.headers["content-disposition"].endswith(f'-{job}.onnx"')

    # a failed export: its page says why, with a link that makes it again
    exports.record_failure(folder / "model.safetensors", "timm", "export-failed", "no dataset")
    failed = b.get(f"/jobs/{job}/model?format=timm")
    assert failed.headers["location"] == f"/jobs/{job}/export/timm"
    html = b.get(failed.headers["location"]).text
    assert 'data-state="failed"' in html and "the timm export failed: no dataset" in html
    assert f'href="/jobs/{job}/model?format=timm&amp;retry=true"' in html
    again = b.get(f"/jobs/{job}/model?format=timm&retry=true")
    assert again.status_code == 303 and "/export/timm?since=" in again.headers["location"]
    assert 'data-state="being-made"' in b.get(again.headers["location"]).text
    # another tenant: not found
    other = sign_in(service_app, make_key(f"fmt-{uuid.uuid4().hex[:6]}").token)
    assert other.get(f"/jobs/{job}/export/onnx").status_code == 404
    assert other.get(f"/jobs/{job}/model?format=onnx").status_code == 404
