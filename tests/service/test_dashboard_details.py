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


def test_zoo_page_and_submit_form_reach_every_model_of_a_zoo_over_100(isolated_settings):
    """With 118 zoo models the zoo page showed the first 100 with no next page and the submit
    form offered only those 100: 18 could be neither seen nor picked. The zoo page now pages
    (a next-page link, as the other lists) and the form offers every model, saying how many
    one job may score when the zoo holds more. A zoo of its own: the shared one stays small."""
    from fastapi.testclient import TestClient

    from zoopick.app.main import create_app
    from zoopick.service.db.models import ZooModel
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import create_api_key

    settings = isolated_settings("zoo-118")
    ids = {f"many-{i:03d}" for i in range(118)}
    app = create_app(settings)
    with TestClient(app):  # the app's lifespan: its database and broker
        with session_scope(app.state.sessionmaker) as session:
            for mid in sorted(ids):
                session.add(ZooModel(id=mid, arch="test_resnet", weights="none", num_classes=3))
            _, token = create_api_key(session, tenant="zoo-118", name="zoo-118")
        b = sign_in(app, token)
        seen: list[str] = []
        url, pages = "/zoo", 0
        while url:
            page = b.get(url)
            assert page.status_code == 200, page.text
            rows = re.findall(r'<tr data-model="([^"]+)">', page.text)
            assert 0 < len(rows) <= 100
            seen += rows
            assert ('href="/zoo">First page' in page.text) == (pages > 0)
            found = re.search(r'<a href="([^"]+)" rel="next">Next page</a>', page.text)
            url = found.group(1).replace("&amp;", "&") if found else None
            pages += 1
        assert pages == 2 and len(seen) == len(ids) and set(seen) == ids
        assert b.get("/zoo?page_token=nonsense").status_code == 400  # the API's, as a page

        form = b.get("/submit").text
        offered = re.findall(r'<input type="checkbox" name="models" value="([^"]+)"', form)
        assert sorted(offered) == sorted(ids)
        limit = settings.max_models_per_job
        assert f"which holds 118: a job scores at most {limit}" in form


def _fine_tuned_job(service_app, tenant_name: str, choices) -> str:
    """A succeeded job of ``tenant_name`` whose fine-tune's recipe chose ``choices``; its id."""
    from zoopick.service.db.models import Job, JobStatus, TrainingRun
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import get_or_create_tenant

    with session_scope(service_app.state.sessionmaker) as session:
        tenant = get_or_create_tenant(session, tenant_name)
        job = Job(tenant_id=tenant.id, request={}, models=["a"], metrics=["logme"],
                  select_by="logme", status=JobStatus.succeeded.value, chosen_model="a",
                  finetune=FinetuneOptions().model_dump(mode="json"))  # fmt: skip
        session.add(job)
        session.flush()
        session.add(TrainingRun(job_id=job.id, model_id="a", config={}, world_size=2,
                                output_dir="/nowhere", status="succeeded",
                                recipe=choices.to_dict()))  # fmt: skip
        return job.id


def test_the_run_page_says_what_the_recipe_chose_with_the_search_curve(service_app, make_key):
    """A fine-tuned job's page shows the recipe's choices: the rate, how it was found, each
    trial of the search (the chosen one marked) and the best validation step."""
    from zoopick.training import recipe

    name = f"recipe-{uuid.uuid4().hex[:6]}"
    b = sign_in(service_app, make_key(name).token)
    plan = recipe.plan(FinetuneOptions(), steps_per_epoch=28, validation=0.1)
    trials = [recipe.Trial(3e-4, 0.71, 1.61), recipe.Trial(1e-3, 0.76, 0.95),
              recipe.Trial(3e-3, 0.89, 0.47), recipe.Trial(3e-3 * 10**0.5, 0.79, 0.63)]  # fmt: skip
    chosen = recipe.Choices(
        plan=plan.to_dict(),
        lr=recipe.pick(trials),
        trials=[vars(t) for t in trials],
        best_step=360,
        best_val_accuracy=0.9889,
    )
    page = b.get(f"/jobs/{_fine_tuned_job(service_app, name, chosen)}")
    assert page.status_code == 200, page.text
    section = page.text[page.text.index('id="recipe"') :]
    assert "adamw at learning rate 0.003" in section, section[:600]
    assert "found by 4 short trials of 32 steps" in section
    assert "step 360" in section and "0.9889" in section
    rows = re.findall(r"<tr( class=\"chosen\")?><td class=\"num\">([0-9.e-]+)", section)
    assert [r[1] for r in rows] == ["0.0003000", "0.001000", "0.003000", "0.009487"], rows
    assert [bool(r[0]) for r in rows] == [False, False, True, False]
    assert "recipe auto, length from the data" in page.text
    assert "every training image" not in section
    # a small dataset's refit run (rules 6): the page says the run trained on every image
    refit = recipe.plan(FinetuneOptions(), steps_per_epoch=9, validation=0.2, refit=True)
    refit_choices = recipe.Choices(plan=refit.to_dict(), lr=1e-3, trials=[vars(t) for t in trials])
    section = b.get(f"/jobs/{_fine_tuned_job(service_app, name, refit_choices)}").text
    section = section[section.index('id="recipe"') :]
    assert "the run trained on every training image" in section, section[:800]
    assert "best validation checkpoint" not in section


def test_the_job_list_shows_the_chosen_models_score(service_app, make_key):
    """Issue 41: the job list had names but no metric column (MLflow's run list shows a
    metric's value): each chosen job's row shows its chosen model's score under the metric
    it was chosen by, not another model's or another metric's; a job with no choice shows
    none."""
    from zoopick.service.db.models import Job, JobStatus, Score
    from zoopick.service.db.session import session_scope
    from zoopick.service.security import get_or_create_tenant

    name = f"scorecol-{uuid.uuid4().hex[:6]}"
    b = sign_in(service_app, make_key(name).token)
    with session_scope(service_app.state.sessionmaker) as session:
        tenant = get_or_create_tenant(session, name)
        done = JobStatus.succeeded.value
        chosen = Job(tenant_id=tenant.id, request={}, models=["a", "b"], metrics=["logme", "sms"],
                     select_by="logme", status=done, chosen_model="b")  # fmt: skip
        queued = Job(tenant_id=tenant.id, request={}, models=["a"], metrics=["logme"],
                     select_by="logme")  # fmt: skip
        session.add_all([chosen, queued])
        session.flush()
        for model, metric, value in [("a", "logme", 9.5), ("b", "logme", 1.23456),
                                     ("b", "sms", 7.0)]:  # fmt: skip
            session.add(Score(job_id=chosen.id, model_id=model, metric=metric, value=value,
                              seconds=1.0))  # fmt: skip
        ids = str(chosen.id), str(queued.id)
    page = b.get("/jobs")
    assert page.status_code == 200 and ">Score</abbr>" in page.text, page.text

    def score(jid: str) -> str:
        row = page.text[page.text.index(f'<tr data-job="{jid}"') :]
        return re.search(r'class="num job-score"[^>]*>([^<]*)<', row).group(1)

    assert score(ids[0]) == "1.235" and score(ids[1]) == ""
