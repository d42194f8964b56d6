"""A person at the console: log in, approve a pending refund after seeing its amount, resolve an
unknown charge; wrong tokens, forged forms and the read-only token refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from conftest import ADMIN_TOKEN, READ_TOKEN
from stack import Stack, eventually


def ui(stack: Stack, path: str) -> str:
    return f"http://127.0.0.1:{stack.admin_port}{path}"


def key_url(stack: Stack, key: str, then: str = "") -> str:
    return ui(stack, f"/ui/keys/{urllib.parse.quote(key, safe='')}{then}")


def post_decision(stack: Stack, key: str, token: str, fields: dict[str, str]) -> tuple[int, str]:
    """Approves `key` as a script would (a bearer token, no browser): the status and body."""
    req = urllib.request.Request(
        key_url(stack, key, "/approve"),
        data=urllib.parse.urlencode(fields).encode(),
        headers={"authorization": f"Bearer {token}", "content-type": "application/x-www-form-urlencoded"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def log_in(driver: WebDriver, stack: Stack, token: str, name: str = "") -> None:
    driver.get(ui(stack, "/ui/login"))
    driver.find_element(By.NAME, "token").send_keys(token)
    if name:
        driver.find_element(By.NAME, "by").send_keys(name)
    driver.find_element(By.CSS_SELECTOR, "form.login button").click()


def wait_for_text(driver: WebDriver, text: str, within: float = 30) -> None:
    # The page may be replaced while it is read (a redirect after a post): read it again.
    WebDriverWait(driver, within, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: text in d.find_element(By.TAG_NAME, "body").text
    )


def status_of(stack: Stack, key: str) -> str:
    return json.loads(stack.idem("explain", key, "--json"))["status"]


def publish(stack: Stack, tool: str, run: str, business: str, args: dict) -> str:
    stack.idem(
        "publish", "--tool", tool, "--run-id", run, "--business-id", business, "--args", json.dumps(args)
    )
    key = f"{run}:{tool}:{business}"
    eventually(f"{key} to be recorded", 30, lambda: _exists(stack, key))
    return key


def _exists(stack: Stack, key: str) -> bool:
    req = urllib.request.Request(
        ui(stack, f"/v1/actions/{urllib.parse.quote(key, safe='')}"),
        headers={"authorization": f"Bearer {READ_TOKEN}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.load(r)["status"] not in ("pending", "running")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise


def test_approve_a_refund_and_resolve_an_unknown_charge(stack: Stack, browser: WebDriver, shots: Path) -> None:
    run = f"run_{uuid.uuid4().hex[:8]}"
    refund = publish(stack, "refund", run, "order_8812", {"order_id": "order_8812", "amount": 120, "memo": "late"})
    assert status_of(stack, refund) == "pending_approval"
    charge_key = f"{run}:charge:order_9"
    stack.script(charge_key, ["effect_then_timeout"])
    charge = publish(stack, "charge", run, "order_9", {"amount": 30})
    assert status_of(stack, charge) == "unknown"
    assert stack.effects(charge) == 1

    # Nothing is shown without logging in.
    browser.get(ui(stack, "/ui/"))
    assert browser.current_url.endswith("/ui/login")
    assert refund not in browser.page_source
    browser.save_screenshot(str(shots / "login.png"))

    log_in(browser, stack, ADMIN_TOKEN, "Ana")
    wait_for_text(browser, refund)
    assert browser.current_url.endswith("/ui/")
    rows = browser.find_elements(By.CSS_SELECTOR, "table.keys tbody tr")
    keys = [r.find_element(By.CSS_SELECTOR, "td a").text for r in rows]
    assert refund in keys and charge in keys
    assert keys.index(refund) < keys.index(charge), "oldest first"
    browser.save_screenshot(str(shots / "waiting.png"))
    # The session cookie is HttpOnly and SameSite=Strict.
    cookie = browser.get_cookie("idem_ui")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    # The key page shows what is being approved: the amount, marked material.
    browser.find_element(By.LINK_TEXT, refund).click()
    wait_for_text(browser, "Fingerprint")
    material = {
        row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[1].text
        for row in browser.find_elements(By.CSS_SELECTOR, "table.args tr.material")
    }
    assert material == {"amount": "120", "order_id": '"order_8812"'}
    browser.save_screenshot(str(shots / "key-pending.png"))
    browser.find_element(By.CSS_SELECTOR, "form.approve textarea[name=reason]").send_keys("customer called; checked")
    browser.find_element(By.CSS_SELECTOR, "form.approve button").click()
    wait_for_text(browser, "Approved")
    eventually("the refund to succeed", 30, lambda: status_of(stack, refund) == "succeeded")
    assert stack.effects(refund) == 1
    browser.refresh()
    wait_for_text(browser, "Ana")  # the decision, recorded under the name given at login
    browser.save_screenshot(str(shots / "key-approved.png"))

    # The unknown charge: looked at downstream, resolved as failed.
    browser.get(key_url(stack, charge))
    wait_for_text(browser, "Resolve")
    Select(browser.find_element(By.CSS_SELECTOR, "form.resolve select[name=as]")).select_by_value("failed")
    browser.find_element(By.CSS_SELECTOR, "form.resolve textarea[name=reason]").send_keys("provider shows no charge")
    browser.find_element(By.CSS_SELECTOR, "form.resolve button").click()
    wait_for_text(browser, "Resolved")
    assert status_of(stack, charge) == "failed"
    browser.save_screenshot(str(shots / "key-resolved.png"))

    browser.get(ui(stack, "/ui/overview"))
    wait_for_text(browser, "Relays holding leases")
    overview = browser.find_element(By.TAG_NAME, "main").text
    assert "refund" in overview
    assert "Keys recorded in the last hour" in overview
    browser.save_screenshot(str(shots / "overview.png"))

    browser.get(ui(stack, f"/ui/search?q={run}"))
    wait_for_text(browser, charge)
    assert refund in browser.page_source
    browser.save_screenshot(str(shots / "search.png"))


def test_wrong_tokens_forged_forms_and_readers_are_refused(stack: Stack, browser: WebDriver, shots: Path) -> None:
    run = f"run_{uuid.uuid4().hex[:8]}"
    refund = publish(stack, "refund", run, "order_77", {"order_id": "order_77", "amount": 999})

    log_in(browser, stack, "not-a-token-0123456789")
    wait_for_text(browser, "not a token of this relay")
    assert browser.get_cookie("idem_ui") is None
    browser.save_screenshot(str(shots / "wrong-token.png"))

    # A form without its CSRF token (removed before posting) changes nothing.
    log_in(browser, stack, ADMIN_TOKEN, "Ana")
    wait_for_text(browser, "Waiting")
    browser.get(key_url(stack, refund))
    wait_for_text(browser, "Decide")
    browser.execute_script("document.querySelector('form.approve input[name=csrf]').remove()")
    browser.find_element(By.CSS_SELECTOR, "form.approve textarea[name=reason]").send_keys("forged")
    browser.find_element(By.CSS_SELECTOR, "form.approve button").click()
    wait_for_text(browser, "CSRF")
    browser.save_screenshot(str(shots / "csrf-refused.png"))
    assert status_of(stack, refund) == "pending_approval"
    assert stack.effects(refund) == 0

    # The read-only token sees the key and its amount, and has no way to decide.
    browser.delete_all_cookies()
    log_in(browser, stack, READ_TOKEN)
    wait_for_text(browser, "read-only token")
    browser.get(key_url(stack, refund))
    wait_for_text(browser, "999")
    assert not browser.find_elements(By.CSS_SELECTOR, "form.approve")
    browser.save_screenshot(str(shots / "reader.png"))
    status, _ = post_decision(stack, refund, READ_TOKEN, {"reason": "x", "fingerprint": "f"})
    assert status == 403, "a reader's decision was accepted"
    assert status_of(stack, refund) == "pending_approval"


def test_a_decision_is_bound_to_the_request_the_page_showed(stack: Stack) -> None:
    run = f"run_{uuid.uuid4().hex[:8]}"
    refund = publish(stack, "refund", run, "order_5", {"order_id": "order_5", "amount": 10})
    status, body = post_decision(
        stack, refund, ADMIN_TOKEN, {"reason": "ok", "fingerprint": "not-the-fingerprint", "by": "Ana"}
    )
    assert status == 409, "a decision on another request was accepted"
    assert "look at it again before deciding" in body
    assert status_of(stack, refund) == "pending_approval"
    assert stack.effects(refund) == 0
