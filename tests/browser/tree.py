"""An agent's tree on its page, in a real browser (Debian's Chromium, driven by
Playwright). Run by tests/dashboard.rs, which starts a server with an agent that has one
child and passes: base URL, API token, parent agent id, child agent id, the parent's own
token (to open a second child as the parent would), workspace id, screenshot directory.
Exits non-zero (with the failed expectation) when the page does not show the tree."""

import json
import os
import sys
import urllib.request

from playwright.sync_api import expect, sync_playwright

BASE, TOKEN, PARENT, CHILD, PARENT_TOKEN, WORKSPACE, SHOTS = sys.argv[1:8]
CHROMIUM = os.environ.get("AGENTRY_CHROMIUM", "/usr/bin/chromium")
expect.set_options(timeout=20_000)


def call(method, path, body=None, token=TOKEN):
    req = urllib.request.Request(
        BASE + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method=method,
    )
    with urllib.request.urlopen(req) as res:
        text = res.read()
        return json.loads(text) if text else None


def main():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(BASE + "/")
        page.evaluate(f"localStorage.setItem('agentry.token', {json.dumps(TOKEN)})")

        # The parent's page lists its child with its status.
        page.goto(f"{BASE}/agents/{PARENT}")
        tree = page.get_by_role("region", name="Agent tree")
        child = tree.locator(f'li[data-child="{CHILD}"]')
        expect(child.get_by_role("link", name="Child one")).to_be_visible()
        expect(child.locator(".badge")).to_have_text("idle")

        # Its status is live: a prompt that asks for permission shows, and so does its end.
        asked = call("POST", f"/v1/agents/{CHILD}/messages", {"text": "/ask may I?"})
        assert asked is not None
        expect(child.locator(".badge")).to_have_text("waiting_permission")
        page.screenshot(path=f"{SHOTS}/agent-tree.png", full_page=True)
        pending = call("GET", f"/v1/agents/{CHILD}/permissions")
        request = pending["items"][0]["request_id"]
        call("POST", f"/v1/agents/{CHILD}/permissions/{request}", {"behavior": "allow"})
        expect(child.locator(".badge")).to_have_text("idle")

        # A child the parent opens now appears; archived, it goes.
        second = call(
            "POST",
            "/v1/agents",
            {"workspace_id": WORKSPACE, "provider": "mock", "title": "Child two"},
            token=PARENT_TOKEN,
        )
        expect(tree.get_by_role("link", name="Child two")).to_be_visible()
        call("DELETE", f"/v1/agents/{second['id']}")
        expect(tree.get_by_role("link", name="Child two")).to_have_count(0)
        expect(child).to_be_visible()

        # The child's page links back to its parent.
        child.get_by_role("link", name="Child one").click()
        expect(page).to_have_url(f"{BASE}/agents/{CHILD}")
        back = page.get_by_role("region", name="Agent tree").get_by_role("link", name="Lead")
        expect(back).to_be_visible()
        expect(page.get_by_role("heading", name="Children")).to_be_hidden()
        back.click()
        expect(page).to_have_url(f"{BASE}/agents/{PARENT}")
        expect(page.get_by_role("region", name="Agent tree").locator(f'li[data-child="{CHILD}"]')).to_be_visible()

        assert not errors, errors
        browser.close()
    print("dashboard tree: ok")


if __name__ == "__main__":
    main()
