"""The dashboard in a real browser (Debian's Chromium, driven by Playwright), against a
real agentry server with the mock provider. Run by tests/dashboard.rs, which starts the
server and passes: base URL, API token, agent id, workspace id, screenshot directory.
Exits non-zero (with the failed expectation) when the dashboard does not behave."""

import json
import os
import re
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request

from playwright.sync_api import expect, sync_playwright

BASE, TOKEN, AGENT, WORKSPACE, SHOTS = sys.argv[1:6]
CHROMIUM = os.environ.get("AGENTRY_CHROMIUM", "/usr/bin/chromium")
expect.set_options(timeout=20_000)


class Cutter:
    """A TCP proxy between the browser and the server whose open connections can be cut,
    as a flaky network would."""

    def __init__(self, target):
        url = urllib.parse.urlparse(target)
        self.target = (url.hostname, url.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.open = []
        self.accepted = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, server]
                self.accepted += 1
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        with self.lock:
            for s in self.open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.open = []


def api(path):
    req = urllib.request.Request(BASE + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req) as res:
        return json.load(res)


def post_anonymous(path, body):
    """A POST without a token (a device that is not signed in yet): status and body."""
    req = urllib.request.Request(
        BASE + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req) as res:
            return res.status, json.load(res)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def last_assistant_text():
    items = api(f"/v1/agents/{AGENT}/timeline?before_seq=1000000&limit=50")["items"]
    return next(e["data"]["text"] for e in items if e["kind"] == "assistant_message")


def send(page, text):
    """Send a prompt; returns a locator of the end of the turn it starts."""
    ends = page.locator(".turn-end")
    before = ends.count()
    page.get_by_label("Message").fill(text)
    page.get_by_role("button", name="Send").click()
    expect(page.get_by_label("Message")).to_have_value("")
    return ends.nth(before)


def watch(page):
    """What a page logs, throws and requests, kept to explain a page that never renders."""
    seen = []
    page.on("console", lambda m: seen.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: seen.append(f"page error: {e}"))
    page.on("requestfinished", lambda r: seen.append(f"done: {r.method} {r.url}"))
    page.on("requestfailed", lambda r: seen.append(f"failed: {r.method} {r.url} {r.failure}"))
    return seen


def rendered(page, locator, seen, name):
    """`locator` becomes visible; if not, the page's screenshot, log and DOM are kept."""
    try:
        expect(locator).to_be_visible()
    except AssertionError:
        page.screenshot(path=f"{SHOTS}/{name}-failed.png", full_page=True)
        print("\n".join(seen), file=sys.stderr)
        print(page.content()[:4000], file=sys.stderr)
        raise


def main():
    proxy = Cutter(BASE)
    site = f"http://127.0.0.1:{proxy.port}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        # Sign in with a token.
        page.goto(site + "/")
        page.get_by_label("API token").fill("agt_pat_not_a_token")
        page.get_by_role("button", name="Sign in with token").click()
        expect(page.get_by_role("alert")).to_contain_text("not valid")
        page.get_by_label("API token").fill(TOKEN)
        page.get_by_role("button", name="Sign in with token").click()
        expect(page.get_by_role("heading", name="Agents")).to_be_visible()
        expect(page.locator(f'tr[data-agent="{AGENT}"]')).to_be_visible()
        page.screenshot(path=f"{SHOTS}/home.png", full_page=True)

        # Open the agent: its status is visible as text. (Once the list has caught up with
        # the team stream, its rows stay put.)
        expect(page.locator("#main")).to_have_attribute("data-live", "true")
        page.locator(f'tr[data-agent="{AGENT}"] a').click()
        expect(page).to_have_url(f"{site}/agents/{AGENT}")
        expect(page.get_by_role("status")).to_have_text("idle")

        # Streaming text arrives and ends whole: the page shows exactly the stored message.
        end = send(page, "/load 300 3")
        expect(end).to_have_text("Turn completed", timeout=60_000)
        shown = page.locator(".msg.assistant").last.inner_text()
        assert shown == last_assistant_text(), "the streamed message is whole, once"

        # A permission request, answered by its option's button.
        end = send(page, "/ask deploy to staging?")
        card = page.get_by_role("region", name="Permission: deploy to staging?")
        expect(card).to_be_visible()
        expect(page.get_by_role("status")).to_have_text("waiting_permission")
        page.screenshot(path=f"{SHOTS}/agent-permission.png", full_page=True)
        card.get_by_role("button", name="Allow").click()
        expect(card).to_contain_text("Allowed")
        expect(end).to_have_text("Turn completed")
        assert "allow" in last_assistant_text()

        # Interrupt a long turn.
        end = send(page, "/sleep 30000")
        expect(page.get_by_role("status")).to_have_text("running")
        page.get_by_role("button", name="Interrupt").click()
        expect(end).to_have_text("Turn canceled")

        # A dropped connection mid-stream: nothing missed, nothing twice.
        messages = page.locator(".msg.assistant")
        before = messages.count()
        end = send(page, "/load 600 5")
        expect(messages).to_have_count(before + 1)
        connections = proxy.accepted
        proxy.cut()
        page.wait_for_timeout(300)
        proxy.cut()
        expect(end).to_have_text("Turn completed", timeout=60_000)
        assert proxy.accepted > connections, "the page reconnected"
        shown = page.locator(".msg.assistant").last.inner_text()
        assert shown == last_assistant_text(), "after the drop: the message is whole, once"

        # Usage per turn as a chart: one bar per turn that reported usage.
        end = send(page, "/usage 1200 340")
        expect(end).to_have_text("Turn completed")
        end = send(page, "/usage 2600 900")
        expect(end).to_have_text("Turn completed")
        chart = page.get_by_role("img", name=re.compile("Usage per turn"))
        expect(chart).to_be_visible()
        expect(chart.locator("g.turn")).to_have_count(2)
        expect(chart.locator("circle.context")).to_have_count(2)
        expect(page.get_by_label("Usage", exact=True)).to_contain_text("2 turns")
        expect(page.get_by_label("Usage", exact=True)).to_contain_text("3.8k tokens in")
        page.get_by_label("Usage", exact=True).screenshot(path=f"{SHOTS}/usage.png")

        # A file written by the agent shows in the workspace's diff.
        end = send(page, "/write notes/todo.md ship the dashboard")
        expect(end).to_have_text("Turn completed")
        end = send(page, '/write src/app.py def main(): return "hi"  # greet')
        expect(end).to_have_text("Turn completed")
        page.screenshot(path=f"{SHOTS}/agent.png", full_page=True)
        page.get_by_role("link", name="Workspace and changes").click()
        expect(page).to_have_url(f"{site}/workspaces/{WORKSPACE}")
        files = page.get_by_role("list", name="Files changed")
        expect(files).to_contain_text("notes/todo.md")
        expect(page.locator("pre.diff")).to_contain_text("+ship the dashboard")
        # Code in the diff is coloured by its language (Python here), as classes.
        python = page.locator("pre.diff span.add", has_text="def main")
        expect(python.locator("span.tok-kw").first).to_have_text("def")
        expect(python.locator("span.tok-str")).to_have_text('"hi"')
        expect(python.locator("span.tok-com")).to_have_text("# greet")
        expect(python).to_have_text('+def main(): return "hi"  # greet')
        page.screenshot(path=f"{SHOTS}/workspace.png", full_page=True)

        # A device sign-in approved on the device page: the device gets a token.
        status, codes = post_anonymous("/auth/device", {"client_name": "agentry CLI on ci-7"})
        assert status == 200, codes
        page.goto(f"{site}/device?code={codes['user_code']}")
        request = page.get_by_role("region", name="Sign-in request")
        expect(request).to_contain_text("agentry CLI on ci-7")
        expect(request).to_contain_text(codes["user_code"])
        page.screenshot(path=f"{SHOTS}/device.png", full_page=True)
        request.get_by_role("button", name="Approve").click()
        expect(page.get_by_role("status")).to_contain_text("Approved")
        status, token = post_anonymous("/auth/device/token", {"device_code": codes["device_code"]})
        assert status == 200, token
        me = urllib.request.urlopen(urllib.request.Request(
            BASE + "/v1/me", headers={"Authorization": f"Bearer {token['access_token']}"}))
        assert json.load(me)["email"] == api("/v1/me")["email"], "the approver's token"

        # A phone-sized screen still works.
        phone = browser.new_context(viewport={"width": 390, "height": 844})
        mobile = phone.new_page()
        mobile.goto(site + "/")
        mobile.evaluate(f"localStorage.setItem('agentry.token', {json.dumps(TOKEN)})")
        # A request refused for the page's old (no) token does not sign out the token
        # stored since, as when another tab signs in meanwhile.
        mobile.evaluate("api('GET', '/v1/me').catch(() => null)")
        stored = mobile.evaluate("localStorage.getItem('agentry.token')")
        assert stored == TOKEN, "a refused request without a token removed the stored token"
        seen = watch(mobile)
        mobile.goto(f"{site}/agents/{AGENT}")
        rendered(mobile, mobile.get_by_role("button", name="Send"), seen, "agent-phone")
        expect(mobile.get_by_role("img", name=re.compile("Usage per turn"))).to_be_visible()
        mobile.screenshot(path=f"{SHOTS}/agent-phone.png", full_page=False)

        # The same pages in a dark colour scheme.
        dark = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="dark")
        night = dark.new_page()
        night.goto(site + "/")
        night.evaluate(f"localStorage.setItem('agentry.token', {json.dumps(TOKEN)})")
        seen = watch(night)
        night.goto(f"{site}/agents/{AGENT}")
        rendered(night, night.get_by_role("img", name=re.compile("Usage per turn")), seen, "agent-dark")
        night.get_by_label("Usage", exact=True).screenshot(path=f"{SHOTS}/usage-dark.png")
        night.screenshot(path=f"{SHOTS}/agent-dark.png", full_page=True)
        night.goto(f"{site}/workspaces/{WORKSPACE}")
        expect(night.locator("pre.diff")).to_contain_text("+ship the dashboard")
        night.screenshot(path=f"{SHOTS}/workspace-dark.png", full_page=True)

        # A long timeline opens on its tail; older pages load when scrolled to.
        if len(sys.argv) > 6:
            long_agent = sys.argv[6]
            started = time.monotonic()
            page.goto(f"{site}/agents/{long_agent}")
            expect(page.locator(".turn-end").last).to_have_text("Turn completed")
            opened = time.monotonic() - started
            count = api(f"/v1/agents/{long_agent}")["last_seq"]
            print(f"dashboard: an agent with {count} events opened in {opened * 1000:.0f} ms")
            shown = page.locator(".timeline > *").count()
            assert shown < 1000, f"only the tail is on the page ({shown} nodes)"
            expect(page.get_by_role("button", name="Load earlier")).to_be_visible()
            page.get_by_role("button", name="Load earlier").click()
            expect(page.locator(".timeline > *")).not_to_have_count(shown)

        assert not errors, f"script errors: {errors}"
        browser.close()


if __name__ == "__main__":
    main()
    print("dashboard: ok")
