"""The usage page and the queued messages of an agent in a real browser (Debian's
Chromium, driven by Playwright). Run by tests/dashboard.rs, which starts the server, spends
0.036 USD in two turns of the mock provider against a 0.10 USD budget, holds an agent on a
permission request with two follow-ups queued, and passes: base URL, API token, screenshot
directory, the held agent's id and the texts of its two queued messages. Exits non-zero
(with the failed expectation) when the dashboard does not behave."""

import json
import re
import sys

from playwright.sync_api import expect, sync_playwright

BASE, TOKEN, SHOTS, HELD, FIRST, SECOND = sys.argv[1:7]
CHROMIUM = "/usr/bin/chromium"
expect.set_options(timeout=20_000)


def signed_in(context, path):
    page = context.new_page()
    page.goto(BASE + "/")
    page.evaluate(f"localStorage.setItem('agentry.token', {json.dumps(TOKEN)})")
    page.goto(BASE + path)
    return page


def main():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = signed_in(context, "/")
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            run(page)
        except Exception:
            page.screenshot(path=f"{SHOTS}/usage-failed.png", full_page=True)
            print(page.locator("#main").inner_text()[:3000], file=sys.stderr)
            raise
        assert not errors, f"script errors: {errors}"
        browser.close()


def run(page):
    page.get_by_role("navigation", name="Pages").get_by_role("link", name="Usage").click()
    expect(page.get_by_role("heading", name=re.compile("^Usage of "))).to_be_visible()
    expect(page).to_have_url(re.compile(r"/teams/[A-Za-z0-9_]+/usage$"))

    month = page.get_by_role("region", name="This month")
    expect(month.get_by_role("group", name="Spend")).to_contain_text("$0.04")
    expect(month.get_by_role("group", name="Turns")).to_contain_text("2")

    # The chart: an image named by its total, one bar per day, today's with the spend.
    spend = page.get_by_role("region", name="Spend over time")
    chart = spend.get_by_role("img", name=re.compile(r"^Spend over time: \$0\.04 from "))
    expect(chart).to_be_visible()
    assert chart.locator("rect.spend").count() >= 1
    today = page.evaluate("new Date().toISOString().slice(0, 10)")
    expect(chart.locator("g.day title", has_text=f"{today}: $0.04, 2 turns")).to_have_count(1)

    by_person = page.get_by_role("table", name="By person")
    expect(by_person.locator("tbody tr")).to_have_count(1)
    expect(by_person.locator("tbody tr").first).to_contain_text("$0.04")
    by_provider = page.get_by_role("table", name="By provider")
    row = by_provider.get_by_role("row", name=re.compile("^mock "))
    expect(row).to_contain_text("2")
    expect(row).to_contain_text("$0.04")

    budget = page.get_by_role("region", name="Budget")
    expect(budget.get_by_label("Cost budget left")).to_have_text("$0.06 left of $0.10")
    expect(budget.get_by_role("meter", name="Cost budget used")).to_have_attribute("max", "0.1")
    page.screenshot(path=f"{SHOTS}/usage-page.png", full_page=True)

    # The held agent: its two follow-ups wait under the composer, in order; one is canceled.
    page.goto(f"{BASE}/agents/{HELD}")
    queued = page.get_by_role("list", name="Queued prompts")
    expect(queued.locator("li")).to_have_count(2)
    expect(queued.locator("li").nth(0)).to_contain_text(FIRST)
    expect(queued.locator("li").nth(1)).to_contain_text(SECOND)
    page.screenshot(path=f"{SHOTS}/queued-prompts.png", full_page=True)
    page.get_by_role("button", name="Cancel queued prompt 2").click()
    expect(queued.locator("li")).to_have_count(1)
    expect(queued).to_contain_text(FIRST)
    # Sent from the composer while the turn waits: queued too.
    page.get_by_label("Message", exact=True).fill("third, from the page")
    page.get_by_role("button", name="Send").click()
    expect(queued.locator("li")).to_have_count(2)
    expect(queued.locator("li").nth(1)).to_contain_text("third, from the page")


if __name__ == "__main__":
    main()
    print("dashboard usage: ok")
