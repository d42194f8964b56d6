"""The operators' console (`/ui/` on the admin listener) in a real browser: Debian's chromium
driven through WebDriver (selenium), against the real relay, Kafka and Postgres; effects
counted at a downstream that does not dedupe. The stack is the Python client's
(``clients/python/tests/stack.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python" / "tests"))

from stack import stack_fixtures  # noqa: E402

ADMIN_TOKEN = "console-admin-token-0123456789"
READ_TOKEN = "console-read-token-0123456789"

TOOLS = """
# No verify and a downstream that does not honour the key: gated by default.
[[tools]]
name = "refund"
class = "dangerous"
key = ["run_id", "tool", "business_id"]
material = ["args.order_id", "args.amount"]
executor = {{ kind = "http", url = "{downstream}/v1/refund", timeout = "2s" }}

# Not gated, no verify: a call that times out is parked unknown for a person.
[[tools]]
name = "charge"
class = "dangerous"
approval = "none"
key = ["run_id", "tool", "business_id"]
material = ["args.amount"]
executor = {{ kind = "http", url = "{downstream}/v1/charge", timeout = "1s" }}
retry = {{ max_attempts = 1 }}
"""


stack, _ = stack_fixtures(
    TOOLS, {"IDEM_ADMIN_TOKEN": ADMIN_TOKEN, "IDEM_ADMIN_READ_TOKEN": READ_TOKEN}
)


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where a test's screenshots go: its own output directory."""
    d = tmp_path / "screenshots"
    d.mkdir()
    return d
