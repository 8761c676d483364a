"""The dashboard in a real browser: headless Chromium (Debian's, driven by Playwright)
against a live server (uvicorn, a Celery worker, PostgreSQL, Redis).

Signs in with the keyboard, uploads through the form, submits a job and watches it reach
``succeeded`` without a reload, checks every model is in every chart, reads the run's details,
sorts the ranking, downloads the model (safetensors; ONNX through the page that follows its
export) and the training log, follows a second job's training
live (phase, epoch, time to go, a growing curve, a cached forward pass), sees a job cancelled
before scoring list its models as never scored and deletes it (asked first), cancels the second
job (through the page that asks first), names and tags a job and finds it by search, deletes an
invalid dataset, is told to pick more than one job to compare, compares two jobs picked in the
list, checks the phone-width layout and signs out; adds and removes a zoo model with an admin's
key; and reads the API's docs pages with every other host out of reach. A screenshot of each page
goes to ``$ZOOPICK_SCREENSHOTS`` (default: ``.artifacts/screenshots``, git-ignored, for CI to
keep as artefacts; the committed ones in docs/screenshots/ come from
``ZOOPICK_SCREENSHOTS=docs/screenshots``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.service.datafiles import imagefolder_zip_bytes, not_a_dataset_zip_bytes
from tests.service.stack import ZOO

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
MODELS = [m for m, _ in ZOO]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing (apt-get install -y chromium)"
)


@pytest.fixture(scope="module")
def stack(live_server):
    return live_server.tenant("web")


@pytest.fixture(scope="module")
def shots() -> Path:
    path = Path(os.environ.get("ZOOPICK_SCREENSHOTS") or ROOT / ".artifacts" / "screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def no_reload_marker(page) -> None:
    """A value that lives only as long as this document: a reload would drop it."""
    page.evaluate("window.__sameDocument = 'yes'")


def still_same_document(page) -> bool:
    return page.evaluate("window.__sameDocument") == "yes"


def pick_dataset(page, label_start: str) -> None:
    """Choose the dataset whose drop-down label starts so (the label goes on with its id and
    date)."""
    select = page.get_by_label("Dataset")
    select.select_option(select.locator("option", has_text=label_start).get_attribute("value"))


def wait_until(page, expression: str, timeout: float = 20.0) -> None:
    """Poll ``expression`` until it is true. (Playwright's ``wait_for_function`` compiles its
    predicate in the page, which the dashboard's content security policy forbids: no eval.)"""
    import time

    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"still false after {timeout} s: {expression}"
        page.wait_for_timeout(100)


def fits_width(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def open_page(browser, **options):
    """A new context's page (1280 x 900, 20 s timeouts) and the list its content security
    policy violations go to: the pages run under their policy, nothing of theirs may break it."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    page = context.new_page()
    page.set_default_timeout(20_000)
    violations: list[str] = []
    page.on(
        "console",
        lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None,
    )
    return context, page, violations


def test_dashboard_in_chromium(stack, browser, shots, tmp_path):
    from playwright.sync_api import expect

    context, page, violations = open_page(browser, accept_downloads=True)

    # sign in with the keyboard only: Tab to the key field, type, Enter
    page.goto(stack.url + "/")
    expect(page).to_have_url(re.compile(r"/login"))
    page.screenshot(path=str(shots / "login.png"), full_page=True)
    for _ in range(6):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "api_key":
            break
    assert page.evaluate("document.activeElement.id") == "api_key"
    page.keyboard.type(stack.key)
    page.keyboard.press("Enter")
    expect(page).to_have_url(stack.url + "/jobs")
    expect(page.get_by_role("link", name="Datasets", exact=True)).to_be_visible()

    # upload through the form: the page follows the validation and shows classes and images
    archive = tmp_path / "pets.zip"
    archive.write_bytes(imagefolder_zip_bytes(n_per_class=6, classes=("cat", "dog", "owl")))
    page.get_by_role("link", name="Datasets", exact=True).click()
    page.get_by_label("Dataset file").set_input_files(str(archive))
    page.get_by_label("Name (optional)").fill("pets")
    page.get_by_role("button", name="Upload").click()
    expect(page).to_have_url(re.compile(r"/datasets/[0-9a-f-]{36}$"))
    expect(page.locator("#dataset-status")).to_have_text("ready", timeout=60_000)
    for name in ("cat", "dog", "owl"):
        expect(page.get_by_role("row", name=f"{name} 6")).to_be_visible()
        expect(page.get_by_role("img", name=f"example of class {name}")).to_have_count(4)
    wait_until(  # every thumbnail loaded as an image (made on the server)
        page,
        "[...document.querySelectorAll('.thumbs img')]"
        ".every(i => i.complete && i.naturalWidth > 0)",
    )
    page.screenshot(path=str(shots / "dataset.png"), full_page=True)

    # an archive the worker cannot use: its page lists why
    notes = tmp_path / "notes.zip"
    notes.write_bytes(not_a_dataset_zip_bytes())
    page.get_by_role("link", name="Datasets", exact=True).click()
    page.get_by_label("Dataset file").set_input_files(str(notes))
    page.get_by_role("button", name="Upload").click()
    expect(page).to_have_url(re.compile(r"/datasets/[0-9a-f-]{36}$"))
    expect(page.locator("#dataset-status")).to_have_text("invalid", timeout=60_000)
    expect(page.locator("#validation-errors li").first).to_contain_text("class")
    page.screenshot(path=str(shots / "dataset-invalid.png"), full_page=True)
    # deleted from its page, which asks first
    page.get_by_role("button", name="Delete dataset").click()
    page.get_by_role("button", name="Yes, delete it").click()
    expect(page.locator("p.note")).to_have_text("Dataset deleted.")
    page.get_by_role("link", name="Datasets", exact=True).click()
    expect(page.get_by_role("link", name="pets")).to_be_visible()
    page.screenshot(path=str(shots / "datasets.png"), full_page=True)

    page.get_by_role("link", name="Zoo", exact=True).click()
    for mid in MODELS:
        expect(page.locator(f'tr[data-model="{mid}"]')).to_be_visible()
    page.screenshot(path=str(shots / "zoo.png"), full_page=True)

    # the submit form: the API's error beside its field, then a good job
    page.get_by_role("link", name="Submit", exact=True).click()
    pick_dataset(page, "pets (18 images")
    # metrics ticked from the registry's list, each said in a line (the defaults ticked)
    expect(page.locator('label.metric:has(input[value="logme"]) small')).to_contain_text("LogME")
    for name in ("fsms", "isms", "logme"):
        page.locator(f'input[name="metrics"][value="{name}"]').uncheck()
    page.get_by_label("Select by (one of the metrics").fill("logme")
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator("#select_by-error")).to_contain_text("one of the requested metrics")
    expect(page.get_by_label("Select by (one of the metrics")).to_have_attribute(
        "aria-invalid", "true"
    )
    page.screenshot(path=str(shots / "submit.png"), full_page=True)
    for mid in MODELS:
        page.locator(f'input[name="models"][value="{mid}"]').check()
    page.locator('input[name="metrics"][value="logme"]').check()  # sms kept ticked
    page.get_by_label("Select by (one of the metrics").fill("logme")
    page.get_by_label("Name (optional)").fill("pets baseline")
    page.get_by_label("Tags (optional").fill("pets, first")
    page.get_by_label("Fine-tune the chosen model").check()
    page.get_by_label("Compressor").select_option("spardl")
    page.get_by_label("Density (fraction of gradients sent)").fill("0.1")
    page.get_by_label("Workers").fill("2")
    page.get_by_label("Epochs (blank: the recipe's length)", exact=True).fill("1")
    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(re.compile(r"/jobs/[0-9a-f-]{36}$"))
    job_url = page.url

    # watch it finish without reloading
    no_reload_marker(page)
    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=150_000)
    assert still_same_document(page)
    chosen = page.locator("#chosen-model").inner_text()
    assert chosen in MODELS
    for metric in ("sms", "logme"):
        chart = page.get_by_role("img", name=f"{metric} score per model")
        for mid in MODELS:
            expect(chart.locator(f'g.bar[data-model="{mid}"]')).to_have_count(1)
    expect(page.get_by_role("img", name="training loss")).to_be_visible()
    accuracy = page.get_by_role("img", name="train and test accuracy")
    for series in ("train (epoch)", "test"):  # train accuracy plotted too, on its own axis
        expect(accuracy.locator(f'g.series[data-series="{series}"] circle')).to_have_count(1)
    expect(accuracy.locator("line.grid")).to_have_count(6 + 5)  # y: 0 to 1, x: 0 to 2
    expect(page.get_by_role("img", name=re.compile("bytes sent per iteration"))).to_be_visible()
    shares = page.locator("td.share").all_inner_texts()  # sparse: a fraction of dense
    assert len(shares) == 1 and 0 < float(shares[0].rstrip("%")) < 100, shares
    expect(page.locator("tr.chosen th")).to_contain_text(chosen)
    # scoring done is 100 % of scoring; the run's details: why, times, options, hosts
    expect(page.locator("#scoring-progress")).to_contain_text("2 of 2 model(s) scored")
    expect(page.locator("#why-chosen")).to_contain_text(f"{chosen} has the highest logme")
    expect(page.locator("#training-phase")).to_have_text("finished")
    expect(page.locator("#job-duration")).to_have_text(re.compile(r"^[\d.]+ s$|min"))
    expect(page.locator('#finetune-options tr[data-option="lr"] td')).not_to_be_empty()
    expect(page.locator('#finetune-options tr[data-option="compressor"] td')).to_have_text("spardl")
    expect(page.locator("#run-workers")).to_have_text("2")
    expect(page.locator("#run-hosts")).not_to_be_empty()
    expect(page.locator("#log-tail")).to_contain_text('"epoch": 1')
    # sortable columns: by sms, up then down (the page's scores, read from its cells)
    sms = page.locator("#ranking").get_by_role("button", name="sms", exact=True)
    for direction, reverse in (("ascending", False), ("descending", True)):
        sms.click()
        # the metrics' columns in the registry's order, as ticked: logme, then sms
        expect(page.locator("#ranking th").nth(3)).to_have_attribute("aria-sort", direction)
        values = [
            float(v) for v in page.locator("#ranking tbody td:nth-of-type(3)").all_inner_texts()
        ]
        assert values == sorted(values, reverse=reverse) and len(values) == 2, values
    page.screenshot(path=str(shots / "job.png"), full_page=True)
    with page.expect_download() as dl:
        page.locator('#downloads li[data-format="safetensors"] a').click()
    saved = tmp_path / "model.safetensors"
    dl.value.save_as(saved)
    from safetensors.numpy import load_file

    assert load_file(str(saved))
    # the whole log behind the link, with this session's cookie (a second download in a row
    # is one Chromium may cancel as an automatic one)
    log = context.request.get(stack.url + page.locator("#log-download").get_attribute("href"))
    assert log.ok and "attachment" in log.headers["content-disposition"]
    assert '"epoch": 1' in log.text()
    # ONNX, made on first request: its page follows the export, then offers the ONNX file
    page.locator('#downloads li[data-format="onnx"] a').click()
    expect(page).to_have_url(re.compile(r"/export/onnx\?since="))
    expect(page.locator("#export-download")).to_be_visible(timeout=120_000)
    page.screenshot(path=str(shots / "export.png"), full_page=True)
    onnx_file = context.request.get(
        stack.url + page.locator("#export-download").get_attribute("href")
    )
    assert onnx_file.ok and onnx_file.headers["content-disposition"].endswith('.onnx"')
    import onnx

    onnx.checker.check_model(onnx.load_from_string(onnx_file.body()))

    # a second, long job: the jobs list shows it move on its own; cancel it from its page
    page.goto(stack.url + "/submit")
    pick_dataset(page, "pets (18 images")
    page.locator(f'input[name="models"][value="{MODELS[0]}"]').check()
    for name in ("fsms", "isms", "sms"):
        page.locator(f'input[name="metrics"][value="{name}"]').uncheck()
    page.get_by_label("Select by (one of the metrics").fill("logme")
    page.get_by_label("Fine-tune the chosen model").check()
    page.get_by_label("Compressor").select_option("dense")
    page.get_by_label("Workers").fill("1")
    # long enough to be running however slowly the page gets to its cancel button (a job
    # whose last epoch ended before the cancel reached it succeeds, as it should)
    page.get_by_label("Epochs (blank: the recipe's length)", exact=True).fill("1000")
    page.get_by_role("button", name="Submit job").click()
    expect(page).to_have_url(re.compile(r"/jobs/[0-9a-f-]{36}$"))
    second = page.url.rsplit("/", 1)[1]
    page.get_by_role("link", name="Jobs", exact=True).click()
    no_reload_marker(page)
    row = page.locator(f'tr[data-job="{second}"]')
    expect(row).to_have_attribute("data-status", re.compile("scoring|training"), timeout=60_000)
    assert still_same_document(page)
    expect(page.locator(f'tr[data-job="{job_url.rsplit("/", 1)[1]}"]')).to_have_attribute(
        "data-status", "succeeded"
    )
    # the page sorts by a column, and keeps that order through the live refreshes
    page.locator("#jobs-table").get_by_role("button", name="Name", exact=True).click()
    expect(page.locator("#jobs-table th").nth(2)).to_have_attribute("aria-sort", "ascending")
    page.wait_for_timeout(1700)
    expect(page.locator("#jobs-table th").nth(2)).to_have_attribute("aria-sort", "ascending")
    names = page.locator("tr[data-job] td.job-name").all_inner_texts()
    assert names[0].startswith("pets baseline") and names[-1] == "", names  # blanks last
    page.screenshot(path=str(shots / "jobs.png"), full_page=True)
    page.get_by_label("Status").select_option("succeeded")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("tr[data-job]")).to_have_count(1)
    # searched by name or tag (any status): the named job alone, its tags beside its name
    page.get_by_label("Status").select_option("")
    page.get_by_label("Search names and tags").fill("BASELINE")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("tr[data-job] td.job-name")).to_have_text("pets baseline pets first")

    # its training, live: the phase with epoch of how many, the time to go, the curve growing
    page.goto(f"{stack.url}/jobs/{second}")
    no_reload_marker(page)
    expect(page.locator("#training-phase")).to_have_text(
        re.compile(r"^(epoch \d+ of 1000(, step \d+ of \d+)?|evaluating epoch \d+ of 1000)$"),
        timeout=60_000,
    )
    # meanwhile a third job, cancelled while the only worker trains the second: none of its
    # models was scored
    with stack.api() as api:
        ds = api.get("/datasets", params={"status": "ready"}).json()["items"][0]["id"]
        third = api.post(
            "/jobs", json={"dataset_id": ds, "models": MODELS, "metrics": ["logme"]}
        ).json()["id"]
        assert api.post(f"/jobs/{third}/cancel").status_code == 202
    expect(page.locator("#training-time")).to_contain_text("to go", timeout=30_000)
    curve = page.get_by_role("img", name="training loss").locator("circle")
    expect(curve).not_to_have_count(0, timeout=30_000)
    seen = curve.count()
    wait_until(
        page,
        f"document.querySelectorAll('svg[aria-label=\"training loss\"] circle').length > {seen}",
        timeout=60,
    )
    assert still_same_document(page)
    # the first job scored this model on this dataset: its forward pass came from the cache
    expect(page.locator(f'tr[data-model="{MODELS[0]}"] .badge.cached')).to_be_visible()
    page.screenshot(path=str(shots / "job-training.png"), full_page=True)

    # Cancel asks first, on a page of its own (no script): "No" keeps the job, "Yes" cancels
    page.get_by_role("button", name="Cancel job").click()
    expect(page).to_have_url(re.compile(rf"/jobs/{second}/cancel"))
    page.screenshot(path=str(shots / "job-cancel-confirm.png"), full_page=True)
    page.get_by_role("link", name="No, keep it").click()
    expect(page).to_have_url(f"{stack.url}/jobs/{second}")
    expect(page.locator("#job-status")).to_have_text(re.compile("scoring|training"))
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Yes, cancel this job").click()  # a form post
    expect(page).to_have_url(re.compile(rf"/jobs/{second}\?"))
    expect(page.locator("p.note")).to_have_text("Cancel requested.")
    no_reload_marker(page)
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=90_000)
    assert still_same_document(page)
    expect(page.get_by_role("button", name="Cancel job")).to_have_count(0)
    page.screenshot(path=str(shots / "job-cancelled.png"), full_page=True)
    page.goto(f"{stack.url}/jobs/{third}")
    expect(page.locator("#job-status")).to_have_text("cancelled")
    expect(page.locator("#never-scored li")).to_have_text(MODELS)
    page.screenshot(path=str(shots / "job-never-scored.png"), full_page=True)
    # a finished job is deleted from its page, which asks first
    page.get_by_role("button", name="Delete job").click()
    page.get_by_role("button", name="Yes, delete it").click()
    expect(page.locator("p.note")).to_have_text(f"Job {third[:8]} deleted.")
    expect(page.locator(f'tr[data-job="{third}"]')).to_have_count(0)

    # compare: tick two jobs in the (live) list, see their rankings and curves side by side
    page.get_by_role("link", name="Jobs", exact=True).click()
    first = job_url.rsplit("/", 1)[1]
    # one ticked is too few: the list again (400) saying what to do, with the tick kept
    page.get_by_label(f"compare job {first[:8]}").check()
    page.get_by_role("button", name="Compare selected jobs").click()
    expect(page.locator("#compare-error")).to_contain_text("pick 2 to 6 jobs")
    expect(page.get_by_label(f"compare job {first[:8]}")).to_be_checked()
    page.screenshot(path=str(shots / "compare-too-few.png"), full_page=True)
    page.get_by_label(f"compare job {second[:8]}").check()
    page.wait_for_timeout(1700)  # a live refresh of the rows keeps the ticks
    expect(page.get_by_label(f"compare job {first[:8]}")).to_be_checked()
    page.get_by_role("button", name="Compare selected jobs").click()
    expect(page).to_have_url(re.compile(r"/compare\?jobs="))
    expect(page.locator("table.ranking")).to_have_count(2)
    expect(page.locator(f'table[data-job="{first}"] tr[data-model="{chosen}"]')).to_be_visible()
    losses = page.get_by_role("img", name="training loss by job")
    expect(losses.locator("g.series")).to_have_count(2)
    page.screenshot(path=str(shots / "compare.png"), full_page=True)
    compare_url = page.url

    # phone width: nothing wider than the screen (tables scroll inside their box)
    page.set_viewport_size({"width": 390, "height": 844})
    for url, name in (
        (job_url, "job-phone.png"),
        (stack.url + "/jobs", "jobs-phone.png"),
        (compare_url, "compare-phone.png"),
    ):
        page.goto(url)
        assert fits_width(page), url
        page.screenshot(path=str(shots / name), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})

    # sign out: the pages need signing in again
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/login"))
    page.goto(stack.url + "/jobs")
    expect(page).to_have_url(re.compile(r"/login\?next=/jobs"))
    assert violations == []
    context.close()


def test_an_admin_adds_and_removes_a_zoo_model_in_chromium(stack, browser, shots):
    """The zoo page of an admin's key: a model added through its form (the API's refusal
    said above the form first, what was typed kept), listed with its origin and the jobs
    that used it, then removed through the page that asks first."""
    from playwright.sync_api import expect

    context, page, violations = open_page(browser)
    page.goto(stack.url + "/login")
    page.get_by_label("API key").fill(stack.admin)
    page.get_by_label("API key").press("Enter")
    expect(page).to_have_url(stack.url + "/jobs")
    page.get_by_role("link", name="Zoo", exact=True).click()
    page.get_by_label("Architecture (timm or hub name)").fill("test_resnet")
    page.get_by_label("Weights: hub, none or a checkpoint path").fill("none")
    page.get_by_label("Id (optional; default: timm's name)").fill("web-zoo-m")
    page.get_by_role("button", name="Add model").click()  # no head size: refused
    expect(page.locator("#zoo-error")).to_contain_text("num_classes")
    expect(page.get_by_label("Id (optional; default: timm's name)")).to_have_value("web-zoo-m")
    page.get_by_label("Head size (optional for hub weights)").fill("4")
    page.locator("summary", has_text="Data config overrides").click()
    page.get_by_label("Input size (3 numbers: channels height width)").fill("3 32 32")
    page.get_by_role("button", name="Add model").click()
    expect(page.locator("p.note")).to_have_text("Model web-zoo-m added.")
    row = page.locator('tr[data-model="web-zoo-m"]')
    expect(row.locator("td[data-jobs]")).to_have_text("0")
    expect(row).to_contain_text("api")
    page.screenshot(path=str(shots / "zoo-admin.png"), full_page=True)
    page.get_by_role("link", name="Remove web-zoo-m").click()
    page.get_by_role("button", name="Yes, remove it").click()
    expect(page.locator("p.note")).to_have_text("Model web-zoo-m removed.")
    expect(page.locator('tr[data-model="web-zoo-m"]')).to_have_count(0)
    for mid in MODELS:  # the others stay
        expect(page.locator(f'tr[data-model="{mid}"]')).to_be_visible()
    assert violations == []
    context.close()


def test_the_api_docs_render_with_nothing_from_elsewhere(stack, browser):
    """``/docs`` and ``/redoc`` in a browser that can reach nothing but this server (every
    other request is refused): Swagger UI renders the OpenAPI 3.1 document (Swagger UI 4,
    which ``swagger-ui-bundle`` ships, refuses it), asking nothing of elsewhere, and ReDoc
    its operations."""
    from playwright.sync_api import expect

    context = browser.new_context()
    elsewhere: list[str] = []

    def only_this_server(route) -> None:
        if route.request.url.startswith(stack.url + "/"):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    context.route("**/*", only_this_server)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(stack.url + "/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("zoopick")
    expect(page.locator(".swagger-ui")).to_contain_text("OAS 3.1")
    expect(
        page.locator(".opblock-summary-path", has_text="/api/v1/jobs/{job_id}")
    ).not_to_have_count(0)
    assert elsewhere == []
    page.goto(stack.url + "/redoc")
    expect(page.get_by_role("heading", name=re.compile(r"^zoopick"))).to_be_visible()
    expect(page.locator("redoc")).to_contain_text("/api/v1/jobs/{job_id}")
    # ReDoc's bundle asks its vendor for the "API docs by Redocly" footer logo: offline,
    # only that picture is missing
    assert set(elsewhere) <= {"https://cdn.redoc.ly/redoc/logo-mini.svg"}, elsewhere
    context.close()
