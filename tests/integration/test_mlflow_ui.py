"""The MLflow UI as a new user's browser shows it: Debian's Chromium with a fresh profile (nothing
saved in its local storage, MLflow's assistant panel left as it opens), sent to the links ctrflow
prints or to the UI's home page. The home page, after the one click the docs give ("Model training"
in the sidebar), leads to the pipeline run; the experiment link lists the pipeline run with its AUC;
the run link shows the AUC, the parameters the steps used, every step's run and the registered model
(links that stay in the tab), and holds the plots; the experiment's Models tab lists the model; the
model page shows the `candidate` alias; no telemetry notice. Screenshots go to test-artifacts/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ctrflow.tracking.ui import experiment_link, model_link, run_link

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
TIMEOUT_MS = 120_000  # the UI's first render on a loaded 2-core machine takes seconds
TELEMETRY_NOTICE = "MLflow collects usage data"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    """A page of a new browser context: a fresh profile, as a first visit is."""
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


@pytest.fixture(scope="module")
def tracked(pipeline_run) -> dict:
    """The pipeline run's experiment id and run name, from the tracking server."""
    from mlflow import MlflowClient

    client = MlflowClient(pipeline_run["url"])
    run = client.get_run(pipeline_run["mlflow_run_id"])
    return {**pipeline_run, "experiment_id": run.info.experiment_id, "run_name": run.info.run_name}


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def test_experiment_link_lists_the_pipeline_run_with_its_auc(page, tracked):
    from playwright.sync_api import expect

    page.goto(experiment_link(tracked["experiment_id"], tracked["url"]))
    # the grid draws a row in parts (pinned name column, scrolled metric columns), each with the run's id
    row = page.locator(f'[role="row"][row-id="{tracked["mlflow_run_id"]}"]')
    expect(row.filter(has_text=tracked["run_name"])).to_be_visible(timeout=TIMEOUT_MS)
    expect(row.get_by_role("gridcell").filter(has_text=repr(tracked["auc"])[:6])).to_be_visible()
    expect(page.get_by_role("columnheader", name="auc").first).to_be_visible()
    shoot(page, "mlflow_ui_runs.png")
    assert TELEMETRY_NOTICE not in page.inner_text("body")


def test_home_page_after_the_model_training_switch_leads_to_the_runs(page, tracked):
    from playwright.sync_api import expect

    page.goto(tracked["url"])
    page.get_by_role("button", name="Model training", exact=True).click()  # the one click the docs give
    page.get_by_role("link", name=tracked["experiment"], exact=True).first.click()
    expect(page.locator(f'[role="row"][row-id="{tracked["mlflow_run_id"]}"]').first).to_be_visible(timeout=TIMEOUT_MS)
    shoot(page, "mlflow_ui_home_to_runs.png")
    page.goto(f"{tracked['url']}/#/experiments/{tracked['experiment_id']}")  # no query: the saved choice holds
    expect(page.locator(f'[role="row"][row-id="{tracked["mlflow_run_id"]}"]').first).to_be_visible(timeout=TIMEOUT_MS)


def test_run_link_shows_the_auc_the_used_params_the_steps_the_model_and_the_plots(page, tracked):
    from mlflow import MlflowClient
    from playwright.sync_api import expect

    model_route = f"#/models/{tracked['model_name']}/versions/{tracked['registered_version']}"
    page.goto(run_link(tracked["experiment_id"], tracked["mlflow_run_id"], tracked["url"]))
    metric = page.get_by_role("row").filter(has_text=re.compile(r"^\s*auc\s*[01]\."))
    expect(metric.first).to_contain_text(repr(tracked["auc"])[:6], timeout=TIMEOUT_MS)
    client = MlflowClient(tracked["url"])
    [train] = client.search_runs([tracked["experiment_id"]], f"tags.`mlflow.parentRunId` = '{tracked['mlflow_run_id']}' "
                                 "and tags.`ctrflow.step` = 'train'")
    used = page.get_by_role("row", name=re.compile(r"^learning_rate "))
    expect(used.first).to_contain_text(train.data.params["optim.lr"])  # not the pipeline's "use the default" 0
    for step in ("evaluate", "train", "export"):
        expect(page.get_by_role("link", name=step, exact=True).first).to_be_visible()
    version = page.locator(f'a[href="{model_route}"]').last  # in "Registered models"
    expect(version).to_contain_text(f"v{tracked['registered_version']}")
    assert TELEMETRY_NOTICE not in page.inner_text("body")
    assert page.locator(".note-editor-preview-content a").count() == 0  # the UI would open them in a new tab
    shoot(page, "mlflow_ui.png")

    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("evaluate", exact=True).last.click()  # the folder of evaluate's plots
    expect(page.get_by_text("calibration.png", exact=True)).to_be_visible()
    page.get_by_text("roc.png", exact=True).click()
    expect(page.get_by_text("evaluate/roc.png", exact=True)).to_be_visible()  # the plot's preview
    shoot(page, "mlflow_ui_plots.png")

    page.goto(run_link(tracked["experiment_id"], tracked["mlflow_run_id"], tracked["url"]))
    page.get_by_role("link", name="train", exact=True).first.click()
    expect(page.get_by_text("optim.lr", exact=True).first).to_be_visible(timeout=TIMEOUT_MS)
    assert train.info.run_id in page.url and len(page.context.pages) == 1  # the same tab
    page.go_back()
    page.locator(f'a[href="{model_route}"]').last.click()
    expect(page.get_by_role("status", name="candidate")).to_be_visible(timeout=TIMEOUT_MS)
    assert len(page.context.pages) == 1
    shoot(page, "mlflow_ui_model_version.png")


def test_experiment_models_tab_lists_the_registered_model(page, tracked):
    from playwright.sync_api import expect

    page.goto(f"{tracked['url']}/#/experiments/{tracked['experiment_id']}/models?workflowType=machine_learning")
    row = page.get_by_role("row").filter(has_text=tracked["model_name"])
    expect(row.filter(has_text=f"v{tracked['registered_version']}").first).to_be_visible(timeout=TIMEOUT_MS)
    shoot(page, "mlflow_ui_models_tab.png")


def test_registry_page_shows_candidate_version(page, tracked):
    from playwright.sync_api import expect

    page.goto(model_link(tracked["model_name"], base=tracked["url"]))
    version = page.get_by_role("row").filter(has_text=f"Version {tracked['registered_version']}")
    expect(version).to_contain_text("candidate", timeout=TIMEOUT_MS)
    shoot(page, "mlflow_ui_model.png")
