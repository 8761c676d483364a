"""Small things a new user of the dashboard met (issue 22): same-named datasets told apart
in the submit form, a favicon instead of a 404, and the form's defaults taken from the one
place that defines them (``training.config.FinetuneOptions``, ``service.jobs``)."""

from __future__ import annotations

import re
import uuid

from tests.service.test_dashboard import _ready_dataset, sign_in
from zoopick.service.jobs import DEFAULT_SELECT_BY
from zoopick.training.config import FinetuneOptions


def test_submit_form_tells_same_named_datasets_apart(service_app, make_key):
    b = sign_in(service_app, make_key(f"names-{uuid.uuid4().hex[:6]}").token)
    ids = [_ready_dataset(b), _ready_dataset(b)]  # both uploaded as shapes.npz
    form = b.get("/submit").text
    labels = {
        ds: re.search(rf'<option value="{ds}"[^>]*>([^<]+)</option>', form).group(1) for ds in ids
    }
    assert all(label.startswith("shapes.npz") for label in labels.values())
    for ds, label in labels.items():  # a short id and the creation date
        assert re.search(rf"\b{ds[:8]}, \d{{4}}-\d\d-\d\d \d\d:\d\d\)$", label), label
    assert len(set(labels.values())) == 2


def test_submit_form_defaults_come_from_the_one_default(service_app, make_key):
    form = sign_in(service_app, make_key(f"dflt-{uuid.uuid4().hex[:6]}").token).get("/submit")

    def value(name: str) -> str:
        return re.search(rf'id="{name}" name="{name}"[^>]* value="([^"]*)"', form.text).group(1)

    assert float(value("density")) == FinetuneOptions().density
    assert value("select_by") == DEFAULT_SELECT_BY


def test_favicon_is_served(client):
    page = client.get("/login")
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in page.text
    for path in ("/static/favicon.svg", "/favicon.ico"):
        icon = client.get(path)
        assert icon.status_code == 200, path
        assert icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.text.lstrip().startswith("<svg")
