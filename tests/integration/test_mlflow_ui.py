"""The MLflow UI, driven by Debian's Chromium: the pipeline run shows its AUC, and the registry
shows the exported model's version with the `candidate` alias. Screenshots go to test-artifacts/."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
TIMEOUT_MS = 90_000  # the UI's first render on a loaded 2-core machine takes seconds
# The UI's own settings: the model-training view (not GenAI) and its assistant panel closed.
UI_SETTINGS = """
localStorage.setItem('mlflow.workflowType_v1', '"machine_learning"');
localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');
localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');
"""


@pytest.fixture(scope="module")
def page():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.add_init_script(UI_SETTINGS)
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def run_url(pipeline_run) -> str:
    from mlflow import MlflowClient

    experiment = MlflowClient(pipeline_run["url"]).get_experiment_by_name(pipeline_run["experiment"])
    return f"{pipeline_run['url']}/#/experiments/{experiment.experiment_id}/runs/{pipeline_run['mlflow_run_id']}"


def test_run_page_shows_auc(page, pipeline_run):
    from playwright.sync_api import expect

    page.goto(run_url(pipeline_run))
    metric = page.get_by_role("row").filter(has_text="evaluate.auc")
    expect(metric).to_contain_text(repr(pipeline_run["auc"])[:6], timeout=TIMEOUT_MS)  # full precision shown
    expect(page.get_by_role("link", name="evaluate", exact=True)).to_be_visible(timeout=TIMEOUT_MS)  # a child run
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "mlflow_ui.png"), full_page=True)


def test_registry_page_shows_candidate_version(page, pipeline_run):
    from playwright.sync_api import expect

    page.goto(f"{pipeline_run['url']}/#/models/{pipeline_run['model_name']}")
    version = page.get_by_role("row").filter(has_text=f"Version {pipeline_run['registered_version']}")
    expect(version).to_contain_text("candidate", timeout=TIMEOUT_MS)
    page.screenshot(path=str(ARTIFACTS / "mlflow_ui_model.png"), full_page=True)
